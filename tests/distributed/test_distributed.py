"""fused_optim.distributed on 2 and 4 gloo ranks (loopback): per-rank trajectories against
mlbench-core's (tests/golden/mlbench_distributed.pt, recorded by
tests/golden/record_mlbench_distributed.py), PowerSGD at full rank against the exact average,
exact resume from a state dict, the collectives one step costs, and bad input raising the same
error on every rank. Each world size is one launch of tests/workers/distributed_worker.py (one process
per rank, all checks in it); the tests read its results. Plus single-process checks."""

from __future__ import annotations

import copy
import pickle
import re
from pathlib import Path

import pytest
import torch

from fused_optim import distributed as d
from processes import run_ranks
from utils import GOLDEN, WORKERS

GOLDEN_RUNS = torch.load(GOLDEN / "mlbench_distributed.pt", weights_only=True)
# float64 (u = 1.1e-16). Ours and mlbench's differ only in summation order (one bucketed reduction
# vs one per tensor, the order of the neighbours' sum, foreach vs per-tensor clip norms, PowerSGD's
# dot products in its CPU kernels and Gram–Schmidt's over all matrices at once): at most
# ~10 roundings per element per step on O(1) values, over 5 steps, amplified at most 10x by
# momentum 0.9 (1 / (1 − 0.9)): 10·5·10 = 500 u ≈ 5.5e-14; Gram–Schmidt and Adam's division can
# double that: 2e-13.
TOL = dict(rtol=2e-13, atol=2e-13)
ALL_REDUCE = f"all_reduce ({d.gloo_group.BACKEND})"  # an all-reduce on the optimizers' threaded gloo group


def launch(world: int | str, tmp: Path) -> list[dict]:
    """Run tests/workers/distributed_worker.py on ``world`` ranks ("missing": its 2-rank missing-rank mode)."""
    n = 2 if world == "missing" else world
    run_ranks(WORKERS / "distributed_worker.py", lambda r: (r, world, tmp), n, tmp)
    return [torch.load(tmp / f"rank{r}.pt", weights_only=True) for r in range(n)]


@pytest.fixture(scope="module")
def ranks2(tmp_path_factory):
    return launch(2, tmp_path_factory.mktemp("dist2"))


@pytest.fixture(scope="module")
def ranks4(tmp_path_factory):
    return launch(4, tmp_path_factory.mktemp("dist4"))


def assert_trajectory(ours, expected, what: str) -> None:
    assert not isinstance(ours, str), f"{what} raised: {ours}"
    assert len(ours) == len(expected)
    for t, (step_ours, step_expected) in enumerate(zip(ours, expected)):
        for i, (a, b) in enumerate(zip(step_ours, step_expected)):
            torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"{what}, step {t}, param {i}: {m}")


@pytest.mark.parametrize("case", [pytest.param(c, id=c["id"]) for c in GOLDEN_RUNS["cases"]])
def test_replays_mlbench_per_rank(case, request):
    """Every rank's params after every step equal mlbench's on that rank (same grads, and for
    PowerSGD / CentralizedSparsifiedSGD the same random draws)."""
    assert GOLDEN_RUNS["reference"].startswith("mlbench-core 3.0.0")
    results = request.getfixturevalue("ranks2" if case["world_size"] == 2 else "ranks4")
    for rank, result in enumerate(results):
        assert_trajectory(result["golden"][case["id"]], case["ranks"][rank]["expected"], f"rank {rank}")


@pytest.mark.parametrize("name", ["centralized_sgd", "powersgd_rank1"])
def test_the_closure_runs_before_the_communication(ranks2, name):
    """Grads produced by the closure given to step() are the ones averaged (mlbench averaged the
    previous grads, then ran the closure)."""
    case = next(c for c in GOLDEN_RUNS["cases"] if c["id"] == name)
    for rank, result in enumerate(ranks2):
        assert_trajectory(result["checks"][f"closure_{name}"], case["ranks"][rank]["expected"], f"rank {rank}")


def test_decentralized_ranks_differ_and_centralized_agree(ranks4):
    """The golden cases are not degenerate: gossip on a ring leaves the 4 models different, while
    all-reduce keeps them identical."""
    ring = [r["golden"]["decentralized_ring_4"][-1][0] for r in ranks4]
    assert not torch.equal(ring[0], ring[1])
    central = [r["golden"]["centralized_sgd_4"][-1][0] for r in ranks4]
    assert all(torch.equal(central[0], c) for c in central)


def test_decentralized_buckets_in_flight_follow_the_single_bucket(ranks4):
    """The ring with one bucket per tensor (the params sent in place) or small buckets, all
    exchanged before the first wait: the same sums in the same order as one bucket, bit for bit."""
    for result in ranks4:
        one_bucket = result["golden"]["decentralized_ring_4"]
        for name, run in result["checks"]["ring_buckets"].items():
            assert not isinstance(run, str), f"{name} raised: {run}"
            for step_a, step_b in zip(run, one_bucket, strict=True):
                assert all(torch.equal(a, b) for a, b in zip(step_a, step_b)), name


def test_powersgd_at_full_rank_is_the_exact_average(ranks2):
    """rank ≥ min(n, m) for every matrix: PowerSGD follows CentralizedSGD (exact all-reduce)."""
    for rank, result in enumerate(ranks2):
        assert_trajectory(result["golden"]["powersgd_full_rank"], result["checks"]["exact_average"], f"rank {rank}")


def test_powersgd_min_compression_rate_and_start_iter(ranks2):
    """torch's options: with min_compression_rate=2 no matrix of the case is worth compressing at
    rank 2 (n·m ≤ 2·(n + m)·2), so every step is the exact average; with start_iter=2 the first
    two steps are, and the third (rank 1, compressed) is not."""
    for rank, result in enumerate(ranks2):
        exact = result["checks"]["exact_average"]
        assert_trajectory(result["checks"]["powersgd_min_compression_rate"], exact, f"rank {rank}")
        late = result["checks"]["powersgd_start_iter"]
        assert_trajectory(late[:2], exact[:2], f"rank {rank}")
        assert (late[2][0] - exact[2][0]).abs().max() > 1e-3


def test_powersgd_takes_channels_last_params(ranks2):
    """A channels_last conv weight (and grad) is compressed as its contiguous twin: the same
    logical matrix. Not bit for bit: the inner SGD updates the non-contiguous weight with its
    reference implementation, the contiguous one with the kernel (float64, an ulp or so per step)."""
    for result in ranks2:
        plain, channels_last = result["checks"]["channels_last"]
        for a, b in zip(plain, channels_last):
            torch.testing.assert_close(a, b, rtol=1e-14, atol=1e-14)


def test_powersgd_takes_matrices_of_several_dtypes(ranks2):
    """A float64 and a float32 matrix: each dtype has its own flat P and Q (a flat buffer, and the
    kernels, take one dtype). With a warm start (queries drawn at the first step only, the float64
    matrix's first) the float64 params follow, bit for bit, a run without the float32 matrix; at full rank both
    matrices follow CentralizedSGD's exact average within TOL, taken in units of each dtype's
    epsilon; a run resumed from a state dict (warm-start Q of both dtypes) continues exactly."""
    ratio = torch.finfo(torch.float32).eps / torch.finfo(torch.float64).eps
    tol32 = {k: v * ratio for k, v in TOL.items()}
    for rank, result in enumerate(ranks2):
        runs = result["checks"]["powersgd_mixed_dtypes"]
        assert not isinstance(runs, str), f"rank {rank} raised: {runs}"
        for mixed, alone in zip(runs["rank1"], runs["float64_only"], strict=True):
            assert torch.equal(mixed[0], alone[0]) and torch.equal(mixed[2], alone[1])
        for t, (full, exact) in enumerate(zip(runs["full_rank"], runs["exact"], strict=True)):
            torch.testing.assert_close(full[0], exact[0], **TOL, msg=lambda m: f"rank {rank}, step {t}: {m}")
            torch.testing.assert_close(full[1], exact[1], **tol32, msg=lambda m: f"rank {rank}, step {t}: {m}")
        assert (runs["rank1"][-1][1] - runs["exact"][-1][1]).abs().max() > 1e-3  # rank 1 compresses the float32 one
        straight, resumed, saved = runs["resume"]
        assert all(torch.equal(a, b) for sa, sb in zip(straight, resumed) for a, b in zip(sa, sb)), f"rank {rank}"
        assert [q.dtype for q in saved["communication"]["q_t"]] == [torch.float64, torch.float32]


def test_powersgd_by_layer_follows_mlbench(ranks2):
    """by_layer=True (P, Q and every exact grad reduced one tensor at a time, all in flight at
    once) sums the same elements as the flat buffers: mlbench's trajectory, within TOL."""
    case = next(c for c in GOLDEN_RUNS["cases"] if c["id"] == "powersgd_rank2_warm_start")
    for rank, result in enumerate(ranks2):
        assert_trajectory(result["checks"]["powersgd_by_layer"], case["ranks"][rank]["expected"], f"rank {rank}")


def test_low_rank_powersgd_is_not_the_exact_average(ranks2):
    """... while rank 1 is lossy (the golden case tests compression, not an all-reduce)."""
    lossy, exact = ranks2[0]["golden"]["powersgd_rank1"], ranks2[0]["checks"]["exact_average"]
    assert (lossy[-1][0] - exact[-1][0]).abs().max() > 1e-3


@pytest.mark.parametrize("name", ["powersgd_resume", "sparsified_resume"])
def test_resume_from_state_dict_continues_exactly(ranks2, name):
    """Saved after 2 of 5 steps (torch.save, then torch.load(weights_only=True)) and loaded into
    a new optimizer, the run continues bit for bit: memories, PowerSGD's warm-start Q, its step
    count and the generators are in the state dict."""
    for rank, result in enumerate(ranks2):
        straight, resumed, saved = result["checks"][name]
        assert len(straight) == len(resumed) == 5
        assert all(torch.equal(a, b) for sa, sb in zip(straight, resumed) for a, b in zip(sa, sb)), f"rank {rank}"
        if name == "powersgd_resume":
            comm = saved["communication"]
            assert {"memories", "q_t", "iteration", "generator"} <= comm.keys() and comm["iteration"] == 2
            assert any(m.abs().max() > 0 for m in comm["memories"])
        else:
            assert "generator" in saved and all("memory" in s for s in saved["state"].values())


def test_a_step_costs_a_few_collectives(ranks2):
    """One all-reduce per bucket (4 tensors fit one), one per tensor with by_layer; PowerSGD: P,
    Q and the exact tensors; gossip: one send and one receive per neighbour. The all-reduces run
    on the threaded gloo group (fused_optim.distributed.gloo_group)."""
    counts = ranks2[0]["checks"]["collectives"]
    assert counts["bucketed"] == {ALL_REDUCE: 1}
    assert counts["by_layer"] == {ALL_REDUCE: 4}
    assert counts["powersgd"] == {ALL_REDUCE: 3}
    assert counts["decentralized"] == {"isend": 1, "irecv": 1}


@pytest.mark.parametrize("case_id", ["centralized_sgd", "custom_clip", "centralized_sgd_4"])
def test_overlap_is_the_synchronous_path_bit_for_bit(case_id, request):
    """overlap=True (buckets all-reduced during the backward) gives the synchronous path's params
    bit for bit: the same buckets hold the same grads, so the sums are the same; with the backward
    before step or inside step's closure, and with two backwards per step (accumulation: a grad
    accumulated after its bucket was launched makes every rank redo the synchronous path). The
    synchronous path itself follows mlbench (custom_clip runs with divide_before=True, exact for
    2 ranks: dividing by 2 rounds nothing)."""
    case = next(c for c in GOLDEN_RUNS["cases"] if c["id"] == case_id)
    for rank, result in enumerate(request.getfixturevalue("ranks4" if case_id.endswith("_4") else "ranks2")):
        runs = result["checks"]["overlap"]
        assert_trajectory(runs[f"{case_id}/sync"], case["ranks"][rank]["expected"], f"rank {rank}")
        for mode in ("overlap", "overlap_closure", "overlap_accumulate", "sync_accumulate"):
            assert all(torch.equal(a, b) for sa, sb in zip(runs[f"{case_id}/sync"], runs[f"{case_id}/{mode}"])
                       for a, b in zip(sa, sb)), f"rank {rank}, {mode}"


def test_a_copy_of_an_overlapping_optimizer_hooks_its_own_params(ranks2):
    """copy.deepcopy of CentralizedSGD(overlap=True) after a step: the copy's backwards launch its
    own all-reduces and both follow the synchronous path bit for bit; dropping the copy leaves
    the original's hooks in place (a copied handle would remove them: no more overlap)."""
    for rank, result in enumerate(ranks2):
        runs = result["checks"]["overlap_copies"]
        assert not isinstance(runs, str), f"rank {rank} raised: {runs}"
        assert runs["launched"] == [True] * 5
        assert all(torch.equal(a, b) for a, b in zip(runs["original"], runs["sync"][3]))
        assert all(torch.equal(a, b) for a, b in zip(runs["copy"], runs["sync"][2]))


def test_overlap_launches_the_buckets_during_the_backward(ranks2):
    """2 buckets: both all-reduces start in the backward, step adds the 1-element staleness
    check; a dropped overlapping optimizer's hooks launch nothing."""
    counts = ranks2[0]["checks"]["overlap_collectives"]
    assert counts["overlap"] == {"backward": {ALL_REDUCE: 2}, "step": {"all_reduce": 1}}
    assert counts["sync"] == {"backward": {}, "step": {ALL_REDUCE: 2}}
    assert counts["dropped"] == counts["sync"]


@pytest.mark.parametrize("name, pattern", [
    ("unequal_params", r"CentralizedSGD: the parameter lists differ across ranks \(rank 0: 2 tensors of 28 elements, "
                       r"rank 1: 3 tensors of 30 elements"),
    ("world_size_mismatch", r"world_size=3 but the process group has 2 ranks: pass world_size=2"),
])
def test_bad_input_raises_on_every_rank_2(ranks2, name, pattern):
    for rank, result in enumerate(ranks2):
        assert result["errors"][name] != "no error", f"rank {rank}"
        assert re.search(pattern, result["errors"][name]), result["errors"][name]


@pytest.mark.parametrize("name, pattern", [
    ("asymmetric", r"not symmetric: rank 0 lists rank 1 but rank 1 does not list rank 0"),
    ("outside", r"neighbours of rank\(s\) \[2\] name a rank outside the group \[0, 4\)"),
])
def test_bad_neighbours_raise_on_every_rank(ranks4, name, pattern):
    """Every rank raises the same error (none waits for a message that never comes)."""
    for rank, result in enumerate(ranks4):
        assert re.search(pattern, result["errors"][name]), f"rank {rank}: {result['errors'][name]}"


def test_a_missing_rank_is_an_error_after_the_timeout_not_a_hang(tmp_path):
    """Rank 1 never constructs the optimizer: rank 0's construction raises, saying what is wrong,
    once the process group's timeout (3 s here) has passed."""
    rank0, _ = launch("missing", tmp_path)
    assert re.search(r"CentralizedSGD: the ranks' agreement check at construction failed: every rank of the "
                     r"process group must construct this optimizer; is a rank missing", rank0["errors"]["missing"])


def test_ring_and_torus_neighbours(ranks4):
    assert d.ring(0, 4) == [1, 3] and d.ring(1, 2) == [0] and d.ring(0, 1) == []
    assert d.torus(4, 3, 3) == [1, 3, 5, 7] and d.torus(8, 3, 3) == [2, 5, 6, 7]
    assert [r["checks"]["torus"] for r in ranks4] == [[1, 2], [0, 3], [0, 3], [1, 2]]


def model_of(*shapes, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Module()
    for i, s in enumerate(shapes):
        model.register_parameter(f"p{i}", torch.nn.Parameter(torch.randn(s, dtype=torch.float64)))
    return model


def test_powersgd_loads_the_warm_start_q_of_the_earlier_layout():
    """Checkpoints from before Q was kept transposed hold each matrix's Q (m × r) under "q": it is
    loaded as the Qᵀ (r × m) the step uses, not copied flat (which would scramble the warm start
    without an error). Those from before Q was kept per dtype hold one flat Qᵀ under "q_t"."""
    opt = d.PowerSGD(model_of((4, 6), (3, 5), (4,)), lr=0.1, rank=2)
    state = opt.state_dict()
    gen = torch.Generator().manual_seed(0)
    qts = [torch.randn(r, m, dtype=torch.float64, generator=gen) for (_, m), r in zip(opt._shapes, opt._ranks)]
    state["communication"]["q"] = torch.cat([qt.t().reshape(-1) for qt in qts])
    opt.load_state_dict(state)
    assert torch.equal(opt.q[0], torch.cat([qt.reshape(-1) for qt in qts]))
    assert "q_t" in opt.state_dict()["communication"]
    del state["communication"]["q"]  # and before Q was kept per dtype: one flat Qᵀ
    state["communication"]["q_t"] = torch.cat([qt.reshape(-1) for qt in qts]) * 2
    opt.load_state_dict(state)
    assert len(opt.q) == 1 and torch.equal(opt.q[0], state["communication"]["q_t"])


def test_single_process_is_the_inner_optimizer():
    """Without a process group (world size 1) nothing is communicated: each class steps as its
    inner optimizer, and step returns the closure's loss. A param without a grad (the second, on
    the second step) is left alone, as torch.optim leaves it (a zero grad would move it: momentum)."""
    grads = [torch.randn(4, 6, dtype=torch.float64), torch.randn(4, dtype=torch.float64)]
    reference = model_of((4, 6), (4,))
    ref = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    models = [model_of((4, 6), (4,)) for _ in range(3)]
    opts = [d.CentralizedSGD(None, models[0], lr=0.1, momentum=0.9),
            d.PowerSGD(models[1], lr=0.1, momentum=0.9),
            d.DecentralizedSGD(0, [], models[2], lr=0.1, momentum=0.9)]
    for step in range(3):
        for m in [reference, *models]:
            for i, (p, g) in enumerate(zip(m.parameters(), grads)):
                p.grad = None if (step, i) == (1, 1) else g.clone()
        ref.step()
        for opt in opts:
            assert opt.step(lambda: 1.5) == 1.5
    for m in models:
        for a, b in zip(m.parameters(), reference.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-15, atol=1e-15)  # the same float64 ops


@pytest.mark.parametrize("make", [
    lambda m: d.CentralizedSGD(None, m, lr=0.1, momentum=0.9),
    lambda m: d.PowerSGD(m, lr=0.1, momentum=0.9, reuse_query=True),
    lambda m: d.DecentralizedSGD(0, [], m, lr=0.1, momentum=0.9),
    lambda m: d.CustomCentralizedOptimizer(m, None, torch.optim.Adam(m.parameters(), lr=0.1)),
    lambda m: d.CentralizedSparsifiedSGD(m.parameters(), lr=0.1, sparse_grad_size=2, random_sparse=True),
], ids=["centralized", "powersgd", "decentralized", "custom", "sparsified"])
@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copies_continue_as_the_original(make, how):
    """copy.deepcopy and pickling (as of any torch.optim optimizer) give an optimizer of copied
    params that continues exactly as the original (they raised AttributeError: torch's
    __setstate__ reads the groups through the inner optimizer before it is set)."""
    model = model_of((4, 6), (4,))
    opt = make(model)
    grads = [torch.randn(4, 6, dtype=torch.float64), torch.randn(4, dtype=torch.float64)]
    for p, g in zip(model.parameters(), grads):
        p.grad = g.clone()
    opt.step()
    twin = copy.deepcopy(opt) if how == "deepcopy" else pickle.loads(pickle.dumps(opt))
    twin_params = [p for group in twin.param_groups for p in group["params"]]
    assert all(a is not b for a, b in zip(twin_params, model.parameters()))
    for _ in range(2):
        for ps in (list(model.parameters()), twin_params):
            for p, g in zip(ps, grads):
                p.grad = g.clone()
        opt.step()
        twin.step()
    assert all(torch.equal(a, b) for a, b in zip(twin_params, model.parameters()))


@pytest.mark.parametrize("make, pattern", [
    (lambda m: d.CentralizedSGD(None, m), r'"lr" not set for optimizer'),
    (lambda m: d.CentralizedSGD(None, None, lr=0.1), r'"model" not set for optimizer'),
    (lambda m: d.CustomCentralizedOptimizer(m, None, torch.optim.SGD(m.parameters(), lr=0.1), average_world=False),
     r"average_world=True .* or average_custom=True"),
    (lambda m: d.CustomCentralizedOptimizer(m, None, torch.optim.SGD(m.parameters(), lr=0.1), grad_clip=0),
     r"Invalid grad_clip: 0"),
    (lambda m: d.PowerSGD(m, lr=0.1, rank=0), r"Invalid rank: 0"),
    (lambda m: d.DecentralizedSGD(0, None, m, lr=0.1), r'"neighbors" not set'),
    (lambda m: d.DecentralizedSGD(0, [1], m, lr=0.1), r"name a rank outside the group \[0, 1\)"),
    (lambda m: d.CentralizedSGD(2, m, lr=0.1), r"world_size=2 but no process group"),
    (lambda m: d.CentralizedSGD(None, m, lr=0.1, agg_grad=False, overlap=True), r"overlap=True .* needs agg_grad=True"),
    (lambda m: d.CustomCentralizedOptimizer(m, None, torch.optim.SGD(m.parameters(), lr=0.1), average_world=False,
                                            average_custom=True, divide_before=True, overlap=True),
     r"overlap=True with divide_before=True divides before step\(denom=...\) is known"),
])
def test_bad_arguments(make, pattern):
    with pytest.raises((ValueError, RuntimeError), match=pattern):
        make(model_of((2, 3)))


def test_frozen_params_are_left_alone():
    """Params that do not require grad are neither communicated nor stepped (weight decay would
    otherwise move them)."""
    m = model_of((2, 3), (3,))
    m.p1.requires_grad_(False)
    frozen = m.p1.detach().clone()
    opt = d.CentralizedSGD(None, m, lr=0.1, weight_decay=0.1)
    m.p0.grad = torch.ones_like(m.p0)
    opt.step()
    assert torch.equal(m.p1, frozen) and [p for g in opt.param_groups for p in g["params"]] == [m.p0]


def test_custom_average_needs_a_divisor():
    m = model_of((2, 3))
    opt = d.CustomCentralizedOptimizer(m, None, torch.optim.SGD(m.parameters(), lr=0.1), average_world=False,
                                       average_custom=True)
    with pytest.raises(ValueError, match=r"average_custom needs step\(denom=...\)"):
        opt.step()


def test_the_threaded_gloo_group_is_made_once_per_default_group_and_ends_with_it():
    """One process, gloo: the all-reduces' group has GLOO_THREADS worker threads and the default
    group's timeout, is the same object on every call, sums on its own, is ended by
    destroy_process_group, and a new default group gets a new one."""
    import datetime

    import torch.distributed as dist

    made = []
    for _ in range(2):
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=17))
        try:
            group = d.gloo_group.collective_group()
            assert d.gloo_group.collective_group() is group
            options = group._get_backend(torch.device("cpu")).options
            assert (options._threads, options._timeout) == (d.gloo_group.GLOO_THREADS, datetime.timedelta(seconds=17))
            t = torch.arange(3.0)
            d.comm.all_reduce_async(t).wait()
            assert torch.equal(t, torch.arange(3.0))
            made.append(group)
        finally:
            dist.destroy_process_group()
    assert made[0] is not made[1]
