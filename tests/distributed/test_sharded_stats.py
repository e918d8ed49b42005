r"""AdaScale's and NoiseScale's statistics from DTensor params (sharded over 2 gloo ranks, one model
replica between them) equal those from the same params whole; under FSDP2 (given the model, each
rank with its own micro-batches) they equal DDP's, and over tensor parallelism (4 ranks, 2 × 2)
those of the whole tensors; FSDP2 without the model, a world size other than the data-parallel
replicas, and a world size above 1 for a replica are refused with the reason
(tests/workers/sharded_stats_worker.py runs each pair in each rank).

Tolerance. Both runs get bitwise equal gradients (the loss is elementwise in each param; under
FSDP2 and DDP each rank sums its micro-batches, and the sums are averaged over the ranks once,
asserted below), so they
differ only in the order the squares are added. A float64 sum of n non-negative terms (each a
rounded square) in any order is within (n + 1)·u of the exact sum, relative (u = 2⁻⁵³), so the
two runs' sums of a group differ by at most δ = 2(n + 1)·u relative, n counting every square of
the window (on every rank), the all-reduces and the fold of the rows. The gain and B_simple are monotone in
each sum (var grows with the micro-batch sums and falls with the ``.grad`` sums, |G|² the other
way, the EWMAs have positive weights, the clamps are monotone, gain = (V + Q)/(V/S + Q) rises
with V and falls with Q, B_simple = ΣV'/ΣQ likewise while both are positive): the sharded value
lies between the math replayed on the whole run's sums moved by δ in the direction that lowers
it and in the one that raises it, widened by 64 ulps for the arithmetic after the sums (a dozen
rounded operations per window, none cancelling: the test checks that V and Q stay positive).
A step of SGD p − lr·gain·g with equal p and g then differs by |lr·g|·|Δgain| plus one rounding
of the param.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from fused_optim import gradient_stats_math as stats
from fused_optim.gradient_stats_math import Window
from processes import run_ranks
from utils import WORKERS

U = 2.0**-53
ULPS_AFTER_SUMS = 64 * U


def _load_worker():
    import importlib.util

    spec = importlib.util.spec_from_file_location("sharded_stats_worker", WORKERS / "sharded_stats_worker.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def worker():
    return _load_worker()


@pytest.fixture(scope="module")
def ranks4(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sharded_stats4")
    run_ranks(WORKERS / "sharded_stats_worker.py", lambda r: (r, 4, tmp), 4, tmp)
    return [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=False) for r in range(4)]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sharded_stats")
    run_ranks(WORKERS / "sharded_stats_worker.py", lambda r: (r, 2, tmp), 2, tmp)
    return [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=False) for r in range(2)]


def sum_bound(worker, world: int, ranks: int = 2) -> float:
    """δ: the relative bound between the two runs' sums of one group (see the module docstring):
    every square of the window (ACCUM micro-batches on each of ``world`` data-parallel indices, all
    params), plus the all-reduce's additions over ``ranks`` ranks and the fold of 2 rows per group."""
    n = world * worker.ACCUM * sum(math.prod(shape) for shape, _, _ in worker.PARAMS) + (ranks - 1) + 2
    return 2 * (n + 1) * U


def replay(worker, records: list[dict], local_factor: float, total_factor: float, world: int) -> list[dict]:
    """The averages after each window of ``records`` (the reference run's), its sums multiplied by
    the factors: the math of a window-end's sums, as the optimizer runs it (N = ``world``,
    c = ACCUM, S = N·c, the default β, bias-corrected EWMAs)."""
    scale, beta = float(world * worker.ACCUM), max(1 - world * worker.ACCUM / 1000, 0.0)
    avg, out = stats.initial_averages(2), []
    for rec in records:
        window = Window([x * local_factor for x in rec["local"]], [x * total_factor for x in rec["total"]],
                        rec["passes"], scale, True)
        avg = stats.averaged(avg, window, 1.0, 1.0, accum=worker.ACCUM, world_size=world, is_scaled_loss=True,
                             beta=beta, debias=True)
        out.append(avg)
    return out


def values(worker, avg: dict, world: int) -> dict:
    """What the runs record, from the averages: the gains (total and per group), B_simple."""
    scale = float(world * worker.ACCUM)
    var, sqr = avg[stats.VAR], avg[stats.SQR]
    return {"gain": stats.gain(sum(var), sum(sqr), scale), "gains": [stats.gain(v, q, scale) for v, q in zip(var, sqr)],
            "b_simple": stats.noise_scale(avg, 4)}


def flat(record: dict, name: str) -> list[float]:
    value = record[name]
    return value if isinstance(value, list) else [value]


def check_window_statistics(worker, sharded: list[dict], reference: list[dict], keys: tuple, world: int,
                            name: str, ranks: int = 2) -> list[dict]:
    """The sharded run's window sums within δ of the reference's (records of "local", "total",
    "passes"), and its gains / B_simple inside the bounds replayed from them; returns the exact
    replay's averages per step."""
    delta = sum_bound(worker, world, ranks)
    assert len(sharded) == len(reference) == worker.STEPS
    exact = replay(worker, reference, 1.0, 1.0, world)
    low = replay(worker, reference, 1 - delta, 1 + delta, world)
    high = replay(worker, reference, 1 + delta, 1 - delta, world)
    for step, (s, w) in enumerate(zip(sharded, reference)):
        where = f"{name}, step {step}"
        assert s["passes"] == w["passes"] == worker.ACCUM, where
        for key in ("local", "total"):  # the window's sums of the whole tensors, per group
            for a, b in zip(s[key], w[key], strict=True):
                assert abs(a - b) <= delta * b, f"{where}: {key} {a} vs {b}"
        # the averages stay positive (no cancellation)
        assert all(v > 0 for k in (stats.VAR, stats.SQR, stats.NOISE_VAR, stats.NOISE_SQR) for v in exact[step][k])
        lo, hi = values(worker, low[step], world), values(worker, high[step], world)
        for key in keys:
            for value, a, b in zip(flat(s, key), flat(lo, key), flat(hi, key), strict=True):
                assert a * (1 - ULPS_AFTER_SUMS) <= value <= b * (1 + ULPS_AFTER_SUMS), f"{where}: {key} {value} " \
                    f"outside [{a}, {b}]"
    assert any(v > 1.5 for v in flat(sharded[-1], keys[0]))  # the statistics measured something
    return exact


def check_equal_statistics(worker, sharded: list[dict], whole: list[dict], keys: tuple, world: int, name: str):
    """:func:`check_window_statistics` against the whole run, whose values are the replay's own,
    and the sharded run's params within what the gains' difference explains."""
    exact = check_window_statistics(worker, sharded, whole, keys, world, name)
    for step, (s, w) in enumerate(zip(sharded, whole)):
        where = f"{name}, step {step}"
        assert {k: w[k] for k in keys} == {k: values(worker, exact[step], world)[k] for k in keys}, where
        # the step: p − lr·gain(k)·g from equal p and g (NoiseScale: the gain is 1 in both)
        for k, (p_s, p_w, before) in enumerate(zip(s["params"], w["params"], w["before"])):
            group = worker.PARAMS[k][2]
            rel_gain = abs(s["gains"][group] / w["gains"][group] - 1) if "gains" in s else 0.0
            atol = (before - p_w).abs() * (rel_gain + 2 * U) + 2 * U * p_w.abs()
            assert ((p_s - p_w).abs() <= atol).all(), f"{where}: param {k}"


def same_on_both_ranks(ranks: list[dict], runs) -> None:
    """Both ranks measured the same whole tensors (``runs(rank's result)``: its records)."""
    def strip(records):
        return [{k: v for k, v in r.items() if k not in ("params", "before", "grads")} for r in records]
    assert strip(runs(ranks[1])) == strip(runs(ranks[0]))


KEYS = [("adascale", ("gain", "gains")), ("noise_scale", ("b_simple",))]


@pytest.mark.slow
@pytest.mark.parametrize("name, keys", KEYS)
def test_statistics_of_dtensor_params_equal_the_whole_params(ranks, worker, name, keys):
    run = ranks[0]["runs"][name]
    assert run["implementation"] == "fused"
    assert not run["warnings"], run["warnings"]  # no reference fallback, no per-param warning
    same_on_both_ranks(ranks, lambda result: result["runs"][name]["sharded"])
    check_equal_statistics(worker, run["sharded"], run["whole"], keys, 1, name)


@pytest.mark.slow
@pytest.mark.parametrize("name, keys", KEYS)
def test_statistics_under_fsdp2_equal_ddps(ranks, worker, name, keys):
    """FSDP2 with ``module=``: N = 2 ranks pooled, as DDP's; each rank's micro-batch norms are
    taken on the tensors FSDP2 unshards, ``.grad``'s on the shards."""
    run = ranks[0]["fsdp2"][name]
    assert run["implementation"] == "fused" and run["world_size"] == 2
    same_on_both_ranks(ranks, lambda result: result["fsdp2"][name]["sharded"])
    for s, w in zip(run["sharded"], run["ddp"]):  # the premise of the tolerance
        assert all(torch.equal(a, b) for a, b in zip(s["grads"], w["grads"], strict=True))
    check_equal_statistics(worker, run["sharded"], run["ddp"], keys, 2, f"fsdp2 {name}")


@pytest.mark.slow
@pytest.mark.parametrize("name, keys", KEYS)
def test_statistics_under_fsdp2_over_tensor_parallelism_equal_the_whole_tensors(ranks4, worker, name, keys):
    """A 2 × 2 mesh (data × tensor parallel): the unsharded params are tensor-parallel DTensors; the
    statistics equal those of the whole params' micro-batch gradients of both data-parallel
    indices, computed in the worker by the same elementwise arithmetic (its averaged ``.grad`` is
    the run's, bit for bit: the premise of δ), with N = 2."""
    for result in ranks4:
        run = result["fsdp2_tensor_parallel"][name]
        assert run["implementation"] == "fused" and run["world_size"] == 2
        for record in run["records"]:
            assert all(torch.equal(a, b) for a, b in zip(record["grads"], record["reference"]["grads"], strict=True))
        reference = [{**record["reference"], "passes": worker.ACCUM} for record in run["records"]]
        check_window_statistics(worker, run["records"], reference, keys, 2, f"fsdp2 over tp {name}", ranks=4)


@pytest.mark.slow
def test_fsdp2_over_tensor_parallelism_with_one_data_parallel_replica(ranks, worker):
    """A 1 × 2 mesh, N = 1: the window's all-reduce still adds the tensor-parallel parts of each
    whole tensor's sums (a rank's own part alone would give each rank other statistics)."""
    for result in ranks:
        run = result["fsdp2_tensor_parallel"]["adascale"]
        assert run["implementation"] == "fused" and run["world_size"] == 1
        reference = [{**record["reference"], "passes": worker.ACCUM} for record in run["records"]]
        check_window_statistics(worker, run["records"], reference, ("gain", "gains"), 1, "fsdp2 over tp, N = 1",
                                ranks=2)


@pytest.mark.slow
def test_fsdp2_over_tensor_parallelism_checks_the_world_size(ranks):
    """N is the number of data-parallel replicas: the ranks / the tensor-parallel mesh's size."""
    for result in ranks:
        assert result["fsdp2_over_tensor_parallel"] == (
            "gradient statistics: world_size=2, but FSDP2 over a tensor-parallel mesh of 2 ranks leaves 1 "
            "data-parallel replicas (of 2 ranks): pass world_size=1")


@pytest.mark.slow
def test_fsdp2_without_the_model_and_several_replicas_are_refused_with_the_reason(ranks):
    for result in ranks:
        refusals = result["refusals"]
        unseen = "have gradients, but no gradient hook saw them in this window's backward passes"
        assert refusals["fsdp2"].startswith(f"RuntimeError: AdaScale.step: DTensor params [0, 1, 2, 3] (in the order "
                                            f"of the param groups) {unseen}")
        # the plain (ignored) last bias counted the passes; the DTensor params 0, 1, 2 were not seen
        assert refusals["fsdp2_unsharded_when_made"].startswith(
            f"RuntimeError: AdaScale.step: DTensor params [0, 1, 2] (in the order of the param groups) {unseen}")
        assert "after model.reshard()" in refusals["fsdp2_unsharded_when_made"]
        assert refusals["copy_watching_fsdp2"].startswith(
            "TypeError: AdaScale given module= watches the params of the model's FSDP2 units, and a copy would hold "
            "copies of them")
        assert refusals["world_size"].startswith("ValueError: NoiseScale: world_size=2 pools the micro-batches")
        assert refusals["no_accumulation"].startswith("RuntimeError: AdaScale needs world_size * "
                                                      "num_gradients_to_accumulate > 1")
        assert refusals["fsdp2_one_replica_claimed"].startswith(
            "RuntimeError: gradient statistics: world_size=1, but the window's all-reduce pools the micro-batches "
            "FSDP2's 2 ranks unshard the params for: pass world_size=2")
        own_messages = ("copy_watching_fsdp2", "fsdp2_one_replica_claimed")
        for message in (m for case, m in refusals.items() if case not in own_messages):
            assert "for FSDP2 (fully_shard), on the plain tensors it unshards them into: pass the sharded " \
                   "model, e.g. AdaScale(optimizer, module=model)" in message


@pytest.mark.slow
def test_grads_no_hook_saw_pass_where_the_window_left_them_or_loaded_them(ranks):
    for result in ranks:
        outcome = result["unseen_grads"]
        assert outcome["window 0"] is None and outcome["window 1"] is None, outcome
        assert outcome["loaded ended window"] is None, outcome
        assert outcome["set by hand"].startswith("AdaScale.step: DTensor params [3] (in the order of the param "
                                                     "groups) have gradients, but no gradient hook saw them")


@pytest.mark.slow
def test_a_param_one_ranks_hooks_never_see_counts_as_seen_where_another_rank_saw_it(ranks):
    """FSDP2 with a layer only rank 0 uses: both ranks step, agreeing (a rank deciding alone would
    refuse on rank 1 only, and the other would wait in its next collective)."""
    outcomes = [result["used_on_one_rank"] for result in ranks]
    assert all("error" not in o for o in outcomes), outcomes
    assert outcomes[0]["gains"] == outcomes[1]["gains"] and min(outcomes[0]["gains"]) > 1.0, outcomes


@pytest.mark.slow
def test_a_sharded_runs_state_resumes_whole_at_a_step_boundary_only(ranks):
    for result in ranks:
        assert result["resumed"]["gain"] == result["resumed"]["saved_gain"] > 1.0
        assert result["resumed_mid_window"].startswith("AdaScale.load_state_dict: the state was saved inside an "
                                                       "accumulation window with 4 rows of sums, and this optimizer "
                                                       "has 2")
