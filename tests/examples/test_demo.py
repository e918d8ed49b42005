"""The demo (``python -m examples.demo``): the experiment plan, the recorder and report, and the demo end to end
through Lightning and through mmengine (``--quick``), checked for consistent, finite numbers."""

import json
import math
import subprocess
import sys

import pytest
import torch

from examples.demo import report, run_demo
from examples.demo.plan import QUICK, Setup, plan_runs
from examples.demo.recorder import Recorder, evaluate, load_result
from examples.digits import DigitsCNN, load_digits

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_plan_gives_every_run_the_same_budget():
    setup = Setup(budget=160)
    runs = {r.name: r for r in plan_runs(setup, (4, 8))}
    assert list(runs) == ["baseline", "adascale-s4", "adascale-s4-ddp", "linear-s4", "adascale-s8", "linear-s8"]
    base = runs["baseline"]
    assert (base.max_steps, base.schedule_steps, base.nominal_gain, base.lr) == (160, 160, 1.0, setup.lr)
    for s in (4, 8):
        ada, lin = runs[f"adascale-s{s}"], runs[f"linear-s{s}"]
        assert (ada.world_size * ada.accumulate, ada.batch_size, ada.lr) == (s, setup.batch_size, setup.lr)
        assert (ada.tau_target, ada.schedule_steps, ada.nominal_gain) == (160, 160, None)
        assert (lin.batch_size, lin.lr, lin.max_steps, lin.nominal_gain) == (s * 8, s * setup.lr, 160 // s, s)
        assert lin.max_steps * lin.nominal_gain == 160  # its τ budget: T
        assert lin.warmup_steps == round(0.1 * 160 // s)
    ddp = runs["adascale-s4-ddp"]
    assert (ddp.world_size, ddp.accumulate, ddp.scale) == (2, 2, 4)


def test_plan_rejects_bad_scales_and_lr_and_skips_ddp_without_an_even_scale():
    assert [r.world_size for r in plan_runs(Setup(budget=150), (3, 5))] == [1] * 5
    with pytest.raises(ValueError, match="Invalid scale: 1"):
        plan_runs(Setup(), (1,))
    with pytest.raises(ValueError, match="Invalid scale: 7 does not divide the budget T = 1600"):
        plan_runs(Setup(), (4, 7))
    with pytest.raises(ValueError, match="Invalid lr: -0.1"):
        Setup(lr=-0.1)
    with pytest.raises(ValueError, match="Invalid state_dtype: 'float16'"):
        Setup(state_dtype="float16")
    with pytest.raises(ValueError, match="Invalid framework: 'keras'"):
        run_demo(framework="keras")


@pytest.mark.slow
def test_cli_reports_a_bad_scale_without_a_traceback(tmp_path):
    out = subprocess.run([sys.executable, "-m", "examples.demo", "--scales", "3", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 2
    assert "python -m examples.demo: error: Invalid scale: 3 does not divide the budget" in out.stderr
    assert "Traceback" not in out.stderr


def test_evaluate_is_the_mean_cross_entropy_and_the_accuracy():
    torch.manual_seed(0)
    model = DigitsCNN()
    images, labels = load_digits("val")
    loss, acc = evaluate(model, images, labels)
    logits = model(images)
    assert loss == pytest.approx(torch.nn.functional.cross_entropy(logits, labels).item(), rel=1e-6)
    assert acc == pytest.approx(100 * (logits.argmax(1) == labels).float().mean().item())
    assert model.training  # restored


def test_recorder_validates_at_even_tau_points_and_after_the_last_update(tmp_path):
    setup = Setup(budget=160, evaluations=8)  # a point every 20 τ
    ada = next(r for r in plan_runs(setup, (4,)) if r.name == "adascale-s4")
    recorder = Recorder(ada, setup, tmp_path, "test")
    model = DigitsCNN()
    recorder.start(model)
    tau = 0.0
    for step, gain in enumerate([3.0] * 30 + [3.5] * 20, 1):  # τ 0 → 160
        tau += gain
        recorder.update(model, step, tau)
    result = recorder.finish(model)
    assert [c["step"] for c in result["curve"]] == [0, 7, 14, 20, 27, 33, 39, 45, 50]
    assert [c["tau"] for c in result["curve"]][:3] == [0.0, 21.0, 42.0]  # the first update at or past 20, 40
    assert (result["steps"], result["tau"], result["gain_min"], result["gain_max"]) == (50, 160.0, 3.0, 3.5)
    assert [g["gain"] for g in result["gains"]] == [3.0] * 30 + [3.5] * 20  # the increments of τ
    assert load_result(ada, tmp_path) == json.loads(json.dumps(result))

    linear = next(r for r in plan_runs(setup, (4,)) if r.name == "linear-s4")
    recorder = Recorder(linear, setup, tmp_path, "test")
    recorder.start(model)
    for step in range(1, 41):
        recorder.update(model, step)  # τ = 4 per update
    result = recorder.finish(model)
    assert [c["step"] for c in result["curve"]] == [0, 5, 10, 15, 20, 25, 30, 35, 40]
    assert (result["tau"], result["gain_min"], result["gains"]) == (160.0, None, [])


def test_load_result_names_a_run_that_wrote_nothing(tmp_path):
    run = plan_runs(Setup(), (4,))[0]
    with pytest.raises(RuntimeError, match="run 'baseline' ended without writing"):
        load_result(run, tmp_path)


def _check_outputs(out, framework: str, scales: tuple[int, ...]):
    """The table, JSON and PNG exist, and their numbers are finite and consistent."""
    assert (out / "demo.png").read_bytes()[:8] == PNG_MAGIC
    data = json.loads((out / "results.json").read_text())
    setup = Setup(**data["setup"])
    assert (data["framework"], setup.budget) == (framework, QUICK["budget"])
    results = {r["run"]["name"]: r for r in data["results"]}
    assert list(results) == [r.name for r in plan_runs(setup, scales)]
    table = (out / "results.md").read_text()
    t = setup.budget
    for name, r in results.items():
        run = r["run"]
        numbers = [r["steps"], r["tau"], r["val_loss"], r["val_acc"], r["wall_s"]]
        assert all(math.isfinite(x) for x in numbers), (name, numbers)
        assert 50 < r["val_acc"] <= 100 and 0 < r["val_loss"] < 2, name  # it learned (chance: 10%, loss 2.3)
        curve = r["curve"]
        assert (curve[0]["step"], curve[0]["tau"]) == (0, 0.0)
        assert (curve[-1]["step"], curve[-1]["tau"]) == (r["steps"], r["tau"])
        assert all(a["tau"] < b["tau"] and a["step"] < b["step"] for a, b in zip(curve, curve[1:]))
        assert (r["val_acc"], r["val_loss"]) == (curve[-1]["val_acc"], curve[-1]["val_loss"])
        if run["method"] == "adascale":
            gains = [g["gain"] for g in r["gains"]]
            assert len(gains) == r["steps"] and all(math.isfinite(g) for g in gains)
            assert 1 - 1e-6 <= min(gains) == r["gain_min"] and r["gain_max"] == max(gains) <= run["scale"] + 1e-6
            assert t <= r["tau"] < t + gains[-1]  # stopped at the first update that reached T
            assert r["tau"] == pytest.approx(sum(gains))
            assert all(g["b_simple"] is not None for g in r["gains"])  # the noise scale panel's points
            assert r["steps"] < t  # fewer updates than the baseline
        else:
            assert r["steps"] == t // run["scale"] and r["tau"] == t and r["gains"] == []
        row = (f"| {run['label']} | {r['val_acc']:.2f} | {r['val_loss']:.4f} | {r['steps']} | "
               f"{t / r['steps']:.1f}× | {r['tau']:.0f} |")
        assert row in table, (row, table)


@pytest.mark.slow
def test_quick_demo_end_to_end_through_lightning(tmp_path):
    # One scale (the default adds S=8: the same runs at another scale, a minute more of the suite).
    out = subprocess.run([sys.executable, "-m", "examples.demo", "--quick", "--scales", "4", "--out",
                          str(tmp_path)], capture_output=True, text=True, timeout=3600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"wrote {tmp_path / 'results.md'}" in out.stdout and "| AdaScale S=4 |" in out.stdout
    assert "AdaScale S=4 (2 ranks × 2)" in out.stderr  # its progress bar: the DDP run trained
    _check_outputs(tmp_path, "lightning", (4,))


@pytest.mark.slow
def test_quick_demo_end_to_end_through_mmengine(tmp_path):
    # With 8-bit momentum: the option reaches every run's config (the Lightning path: the test below).
    out = subprocess.run([sys.executable, "-m", "examples.demo", "--quick", "--framework", "mmengine",
                          "--scales", "4", "--state-dtype", "8bit", "--out", str(tmp_path)], capture_output=True,
                         text=True, timeout=3600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    _check_outputs(tmp_path, "mmengine", (4,))
    assert "FusedSGD momentum 0.9 (8bit state)" in (tmp_path / "results.md").read_text()
    from mmengine.config import Config

    dumped = Config.fromfile(next((tmp_path / "runs" / "mmengine" / "adascale-s4-ddp").glob("*.py")))
    assert (dumped.launcher, dumped.optim_wrapper.type, dumped.optim_wrapper.accumulative_counts) == (
        "pytorch", "mmengine_optim.AdaScaleOptimWrapper", 2)
    assert dumped.optim_wrapper.optimizer.state_dtype == "8bit"


@pytest.mark.parametrize("state_dtype, stored", [(None, torch.float32), ("bfloat16", torch.bfloat16),
                                                 ("8bit", torch.uint8)])
def test_lightning_module_keeps_the_momentum_buffer_in_the_setups_state_dtype(state_dtype, stored):
    from examples.demo.lightning_runs import DigitsModule

    setup = Setup(state_dtype=state_dtype)
    module = DigitsModule(plan_runs(setup, (4,))[0], setup)
    opt = module.configure_optimizers()["optimizer"]
    assert opt.param_groups[0].get("state_dtype") == state_dtype  # no key at all for fp32 state
    for p in module.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    assert {opt.state[p]["momentum_buffer"].dtype for p in module.parameters()} == {stored}


def test_report_table_and_plot_from_results(tmp_path):
    setup = Setup(budget=40)
    runs = plan_runs(setup, (4,))
    results = []
    for run in runs:
        steps = 40 // run.scale if run.method != "adascale" else 16
        gains = ([dict(step=i, tau=2.5 * i, gain=2.5, b_simple=40.0 + i) for i in range(1, steps + 1)]
                 if run.method == "adascale" else [])
        curve = [dict(step=0, tau=0.0, val_loss=2.3, val_acc=10.0), dict(step=steps, tau=40.0, val_loss=0.5,
                                                                          val_acc=90.0)]
        results.append(dict(run=run.to_dict(), steps=steps, tau=40.0, val_loss=0.5, val_acc=90.0,
                            gain_min=2.5 if gains else None, gain_max=2.5 if gains else None, wall_s=1.0,
                            curve=curve, gains=gains))
    md = report.table(results, setup, "lightning")
    assert "| AdaScale S=4 | 90.00 | 0.5000 | 16 | 2.5× | 40 | 2.50–2.50 | 1.0 |" in md
    assert "| linear S=4 + warm-up | 90.00 | 0.5000 | 10 | 4.0× | 40 | — | 1.0 |" in md
    report.plot(results, setup, tmp_path / "demo.png", "mmengine", quick=True)
    assert (tmp_path / "demo.png").read_bytes()[:8] == PNG_MAGIC
    fig = report.figure(results, setup, "title")
    assert all(ax.get_legend() is not None and ax.get_legend().get_texts() for ax in fig.axes)
    assert "validation accuracy %" in [ax.get_ylabel() for ax in fig.axes]
    log_axes = [ax for ax in fig.axes if ax.get_yscale() == "log"]
    fig.canvas.draw()
    for ax in log_axes:  # plain numbers (no 10^x mathtext), none of them on the minor ticks
        labels = [t.get_text() for t in ax.get_yticklabels() if t.get_text()]
        assert labels and not any("$" in t for t in labels), labels
        assert not [t.get_text() for t in ax.get_yticklabels(minor=True) if t.get_text()]


def test_a_second_run_keeps_the_first_runs_results_unless_forced(tmp_path, monkeypatch):
    """The default folder is per framework and mode, and a folder holding results is refused
    before any training, unless ``force``."""
    from examples.demo import default_out

    assert default_out("lightning", quick=False) != default_out("lightning", quick=True)
    assert default_out("lightning", quick=False) != default_out("mmengine", quick=False)
    (tmp_path / "results.json").write_text("{}")
    with pytest.raises(ValueError, match="holds the results of an earlier run; give another --out, or --force"):
        run_demo(tmp_path, quick=True)
    assert (tmp_path / "results.json").read_text() == "{}"


@pytest.mark.slow
def test_the_cli_refuses_to_overwrite_without_force(tmp_path):
    (tmp_path / "results.json").write_text("{}")
    out = subprocess.run([sys.executable, "-m", "examples.demo", "--quick", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 2 and "--force to replace them" in out.stderr and "Traceback" not in out.stderr
