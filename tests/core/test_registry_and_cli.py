"""The name registry and the `fused-optim` command."""

import inspect
import json
import shutil
import subprocess
import sys

import pytest
import torch

import fused_optim
from benchmarks import optimizers as bench
from benchmarks.__main__ import main as bench_main
from fused_optim.registry import create_optimizer, get_spec, list_optimizers


def test_names_create_the_right_variant():
    p = [torch.nn.Parameter(torch.zeros(2))]
    adam = create_optimizer("Adam", p, lr=0.1)
    assert type(adam) is fused_optim.Adam and adam.defaults["decoupled_weight_decay"] is False
    adamw = create_optimizer("adamw", p)
    assert type(adamw) is fused_optim.AdamW
    assert {k: adamw.defaults[k] for k in ("decoupled_weight_decay", "weight_decay")} == {
        "decoupled_weight_decay": True, "weight_decay": 1e-2}  # torch.optim.AdamW's defaults
    sgd = create_optimizer("sgd", p, momentum=0.9)
    assert type(sgd) is fused_optim.SGD and sgd.defaults["momentum"] == 0.9 and sgd.defaults["lr"] == 1e-3
    assert create_optimizer("fused_adam", p).defaults["weight_decay"] == 0.0  # apex FusedAdam's default


def constructor_defaults(cls) -> dict:
    """The defaults of ``cls``'s constructor arguments (None, "not given", left out)."""
    return {k: v.default for k, v in inspect.signature(cls).parameters.items()
            if v.default is not inspect.Parameter.empty and v.default is not None}


# Defaults the classes keep from the libraries they follow (apex, ColossalAI, timm, mlbench); a
# registry entry has them unless it sets its own.
PUBLISHED_DEFAULTS = {
    fused_optim.FusedLAMB: {"use_nvlamb": False, "max_grad_norm": 1.0},
    fused_optim.ColossalLamb: {"adam": False},
    fused_optim.LARS: {"trust_clip": False},
    fused_optim.ColossalLars: {"lars": True, "eeta": 1e-3},
    fused_optim.SignSGD: {"momentum": 0.0},
    fused_optim.SparsifiedSGD: {"sparse_grad_size": 10},
}


@pytest.mark.parametrize("name", list_optimizers())
def test_each_name_creates_its_class_with_the_entry_defaults(name):
    """The entry's class, whose group defaults are the entry's defaults over the class's
    (e.g. ``nvlamb``: ``use_nvlamb=True``, ``lamb``: ``use_nvlamb=False, max_grad_norm=1.0``)."""
    entry = get_spec(name)
    opt = create_optimizer(name, [torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    assert type(opt) is entry.cls
    expected = {**constructor_defaults(entry.cls), **PUBLISHED_DEFAULTS.get(entry.cls, {}), **entry.defaults,
                "lr": 0.1}
    assert entry.defaults.keys() <= opt.defaults.keys()
    assert {k: opt.defaults[k] for k in expected if k in opt.defaults} == {
        k: v for k, v in expected.items() if k in opt.defaults}


def test_colossalai_class_names_are_aliases_of_the_colossal_classes():
    """ColossalAI's Lars / Lamb: our ColossalLars / ColossalLamb under ColossalAI's names."""
    assert fused_optim.registry.CLASS_ALIASES == {"Lars": fused_optim.ColossalLars, "Lamb": fused_optim.ColossalLamb}
    assert fused_optim.Lars is fused_optim.ColossalLars and fused_optim.Lamb is fused_optim.ColossalLamb
    assert (fused_optim.Lars.__name__, fused_optim.Lamb.__name__) == ("ColossalLars", "ColossalLamb")
    assert {"ColossalLars", "ColossalLamb", "Lars", "Lamb"} <= set(fused_optim.__all__)


@pytest.mark.parametrize("name", ["adamx", None, 3], ids=["misspelt", "none", "int"])
def test_unknown_name_lists_the_known_ones(name):
    with pytest.raises(ValueError, match=rf"Unknown optimizer name {name!r}; available: adagrad, adam, adamw"):
        create_optimizer(name, [torch.nn.Parameter(torch.zeros(1))])


def cli(*args, timeout=1800):
    exe = shutil.which("fused-optim") or ""
    cmd = [exe, *args] if exe else [sys.executable, "-m", "fused_optim.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("repeats", ["0", "-3", "two"])
def test_bench_refuses_a_repeat_count_below_one_before_running(repeats, capsys):
    with pytest.raises(SystemExit) as exit_:
        bench_main(["--repeats", repeats])
    assert exit_.value.code == 2 and f"--repeats: {repeats!r} is not an int >= 1" in capsys.readouterr().err


@pytest.mark.slow
def test_info_reports_the_build():
    out = cli("info")
    assert out.returncode == 0, out.stderr
    assert "CPU kernels      built" in out.stdout and "torch            2." in out.stdout


@pytest.mark.slow
def test_build_reports_timing():
    out = cli("build")
    assert out.returncode == 0 and "CPU kernels ready in" in out.stdout


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_bench_flags_a_mode_that_skips_part_of_the_step(monkeypatch, opt, dtype):
    """A variant that leaves the params alone, or undoes its step on half of them, is flagged;
    ours and torch's foreach mode agree with torch's single-tensor mode."""
    real = bench.variants

    def half_step(ps):
        step = real(opt)["torch single"](ps)

        def run():
            before = [p.detach().clone() for p in ps]
            step()
            with torch.no_grad():
                for p, b in zip(ps, before):
                    p[: p.numel() // 2] = b[: p.numel() // 2]

        return run

    monkeypatch.setattr(bench, "variants",
                        lambda name: {**real(name), "no step": lambda ps: (lambda: None), "half step": half_step})
    wrong = bench._step_disagreements(opt, dtype)
    assert wrong >= {"no step", "half step"} and not wrong & {"fused_optim", "torch foreach"}


def test_bench_writes_json_and_markdown(tmp_path):
    assert bench_main(["--quick", "--repeats", "1", "--lists", "1M", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "bench.json").read_text())
    variants = {(r["optimizer"], r["dtype"], r["variant"]) for r in data["rows"]}
    assert ("adamw", "bfloat16", "torch fused") in variants and ("sgd", "float32", "fused_optim") in variants
    assert {("lamb", "float32", "fused_optim"), ("lars", "bfloat16", "fused_optim"),
            ("norm", "float32", "fused_optim")} <= variants
    if data["timm"]:  # installed by `make install`; optional elsewhere
        assert ("lamb", "float32", "timm foreach") in variants and ("lars", "float32", "timm single") in variants
    assert all(r["ms_per_step"] > 0 and r["fraction_of_probe"] > 0 for r in data["rows"])
    lamb = next(r for r in data["rows"] if r["optimizer"] == "lamb" and r["variant"] == "fused_optim")
    assert lamb["time_vs_fused_adam"] > 0
    md = (tmp_path / "bench.md").read_text()
    assert "| sgd | float32 | 200 tensors / 1M | fused_optim |" in md
    wrong = {(r["optimizer"], r["dtype"], r["variant"]) for r in data["rows"] if r["wrong"]}
    assert all(v[2].startswith("torch") for v in wrong) and ("⚠ wrong results" in md) == bool(wrong)
    (adascale,) = data["adascale"]
    assert adascale["tensors"] == 200 and adascale["bare_ms"] > 0
    assert adascale["fused_optim.AdaScale"]["ms"] > 0 and "fairscale AdaScale" in adascale  # installed by make
    assert f"| 200 tensors / 1.0M | {adascale['bare_ms']:.2f} |" in md


def test_distributed_names_create_the_distributed_optimizers(capsys):
    """The distributed table: each name builds its class over the params given first (world size
    1: no process group), keyword arguments reach it, and `fused-optim list` shows both tables;
    the single-process list stays the kernels' (the distributed classes wrap one of them)."""
    from fused_optim import distributed as fd
    from fused_optim.cli import main
    from fused_optim.registry import list_distributed_optimizers

    def params():
        return [torch.nn.Parameter(torch.zeros(2, 3))]

    built = {name: create_optimizer(name, params(), lr=0.1) for name in list_distributed_optimizers()
             if name != "custom_centralized"}
    built["custom_centralized"] = create_optimizer("custom_centralized", params(), grad_clip=2.0,
                                                   optimizer=dict(type="adamw", lr=0.1))
    assert {name: type(opt).__name__ for name, opt in built.items()} == {
        "centralized_sgd": "CentralizedSGD", "centralized_adam": "CentralizedAdam",
        "custom_centralized": "CustomCentralizedOptimizer", "powersgd": "PowerSGD",
        "decentralized_sgd": "DecentralizedSGD", "centralized_sparsified_sgd": "CentralizedSparsifiedSGD"}
    custom = built["custom_centralized"]
    assert type(custom.optimizer) is fused_optim.AdamW and custom.grad_clip == 2
    assert create_optimizer("powersgd", params(), lr=0.1, rank=3).rank == 3
    assert isinstance(create_optimizer("centralized_sgd", params(), lr=0.1, momentum=0.5).optimizer, fused_optim.SGD)
    assert not set(list_distributed_optimizers()) & set(list_optimizers())
    assert all(isinstance(opt, torch.optim.Optimizer) and isinstance(opt, getattr(fd, type(opt).__name__))
               for opt in built.values())
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert all(f"  {name} " in out for name in list_optimizers() + list_distributed_optimizers())
    with pytest.raises(ValueError, match=r"Unknown optimizer name 'powersg'; available: .*; distributed: .*powersgd"):
        create_optimizer("powersg", params())


def test_cli_without_a_command_prints_the_help(capsys):
    from fused_optim.cli import main

    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: fused-optim") and all(f"    {name} " in out for name in ("info", "build", "list"))


@pytest.mark.parametrize("command", [[], ["info"], ["build"], ["list"]], ids=["top", "info", "build", "list"])
def test_cli_help_is_plain_text_with_a_description(command, capsys):
    """Every help page says what its command does, in plain text (no reStructuredText markup)."""
    from fused_optim.cli import main

    with pytest.raises(SystemExit) as exit_:
        main([*command, "--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and "``" not in out
    description = out.split("\n\n")[1]  # argparse: usage, blank line, description, blank line, ...
    assert not description.startswith(("options:", "positional arguments:")) and len(description.split()) >= 8
