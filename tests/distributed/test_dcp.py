"""``torch.distributed.checkpoint`` (DCP) of FSDP2 models with our optimizers
(tests/workers/dcp_worker.py): ``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` with
``dcp.save`` / ``dcp.load``, saved on 2 gloo ranks after K steps, loaded into a fresh model and
optimizer on 2 ranks and, resharded, on 4.

* Same world size: the resumed run is the uninterrupted one bit for bit, params and every state
  tensor (masters, bf16 moments, rounding keys), for every case: the same code on the same shards
  from the same numbers, LARS and FusedLAMB included. Also where the resumed optimizer keeps its
  moments in another format than the saved one (bf16 ↔ fp32): the uninterrupted run then goes on
  with such an optimizer given the state by a plain ``load_state_dict``.
* 2 → 4 ranks: each shard of an elementwise update is the update of those elements of the whole
  tensor (tests/distributed/test_sharded.py), stochastic rounding included (a shard's elements
  draw the random bits of their indices in the whole tensor: tests/core/test_element_offsets.py),
  so the run resumed on 4 ranks equals the same model trained unsharded in one process bit for
  bit, and so the uninterrupted 2-rank run. Not LARS and FusedLAMB, whose norms of the whole
  tensors are summed from the shards (another order of float64 sums), for which the resumed
  4-rank run must still carry on the saved state (step counts): those equal the unsharded run
  within a derived tolerance, on 2 ranks and resumed on 4.
* 8-bit state is blocked per shard (fused_optim/sharded_blocks.py): it resumes on 2 ranks bit for
  bit like every case, but it is not the unsharded run's (the MLP's shards do not hold whole
  blocks of 256), and on 4 ranks it is refused: ``dcp.load`` finds its absmaxes of [2 shards, B]
  where the 4-rank optimizer has [4, B]. An 8-bit checkpoint of unsharded params is refused at
  load too.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from processes import run_ranks
from utils import WORKERS

WORKER = WORKERS / "dcp_worker.py"
K = 3  # the worker's steps before and after the checkpoint
LAYERWISE = ("lars", "fused_lamb")
PER_SHARD = ("state_8bit",)  # resumed on the saved world size only
SHARD_DEPENDENT = LAYERWISE + PER_SHARD  # cases whose numbers depend on the shards (see above)
# LARS and FusedLAMB sharded against unsharded (tests/distributed/test_sharded.py derives it): per
# step one rounding of the fp32 update lr·r·u (2⁻²⁴·lr·|u| ≤ 2⁻²⁴·0.1) and one ulp of the param
# where a product rounds the other way (2⁻²³·|p|, |p| ≤ 1 in this MLP), over the 2·K steps; the
# params' differences feed back through the grads scaled by lr = 1e-2, far below that.
LAYERWISE_TOL = dict(rtol=0.0, atol=2 * K * (2**-24 * 0.1 + 2**-23 * 1))


def launch(world: int, out: Path, phase: str) -> list[dict]:
    run_ranks(WORKER, lambda r: (r, world, out, phase), world, out)
    return [torch.load(out / f"{phase}{world}_rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The save run (2 ranks), then the resumed runs on 2 and on 4 ranks."""
    out = tmp_path_factory.mktemp("dcp")
    return {phase: launch(world, out, phase.rstrip("24")) for phase, world in
            (("save2", 2), ("resume2", 2), ("resume4", 4))}


def _no_errors(ranks: list[dict], phase: str) -> None:
    for r, result in enumerate(ranks):
        assert not result["errors"], f"{phase} rank {r}: " + "\n".join(f"{c}: {m}" for c, m in result["errors"].items())


def _assert_equal(got: dict, expected: dict, what: str) -> None:
    assert got.keys() == expected.keys(), f"{what}: {sorted(got)} != {sorted(expected)}"
    for key, value in expected.items():
        assert got[key].dtype == value.dtype, f"{what} {key}: {got[key].dtype} != {value.dtype}"
        assert torch.equal(got[key], value), f"{what} {key} differs"


@pytest.mark.slow
def test_resume_same_world_size_is_exact(runs):
    _no_errors(runs["save2"], "save")
    _no_errors(runs["resume2"], "resume")
    for r, (saved, resumed) in enumerate(zip(runs["save2"], runs["resume2"])):
        assert saved["runs"].keys() == resumed["runs"].keys()
        for case, expected in saved["runs"].items():
            got = resumed["runs"][case]
            assert got["implementation"] == "fused", f"{case}: stepped by {got['implementation']}"
            _assert_equal(got["params"], expected["params"], f"rank {r}, {case}: param")
            for fqn, state in expected["state"].items():
                _assert_equal(got["state"][fqn], state, f"rank {r}, {case}: state of {fqn}")


@pytest.mark.slow
def test_resume_on_four_ranks_reshards(runs):
    _no_errors(runs["resume4"], "resume on 4 ranks")
    saved = runs["save2"][0]
    for r, resumed in enumerate(runs["resume4"]):
        for case, expected in saved["runs"].items():
            if any(word in case for word in PER_SHARD):  # (refused: test_8bit_state_resumes_on_its_shards_only)
                continue
            got = resumed["runs"][case]
            what = f"rank {r} of 4, {case}"
            assert got["implementation"] == "fused", f"{what}: stepped by {got['implementation']}"
            for fqn, state in expected["state"].items():  # counters go on from the checkpoint
                assert got["state"][fqn].keys() == state.keys(), f"{what}: state keys of {fqn}"
                for key in ("step", "rounding_key"):  # (SGD's state has neither; Adam's no key)
                    if key in state:
                        assert torch.equal(got["state"][fqn][key], state[key]), f"{what}: {key} of {fqn}"
            if any(word in case for word in SHARD_DEPENDENT):
                continue
            _assert_equal(got["params"], saved["whole"][case], f"{what}: param (against the unsharded run)")
            _assert_equal(got["params"], expected["params"], f"{what}: param (against the 2-rank run)")
            for fqn, state in expected["state"].items():
                _assert_equal(got["state"][fqn], state, f"{what}: state of {fqn}")


@pytest.mark.slow
def test_8bit_state_resumes_on_its_shards_only(runs):
    """Blocked per shard, 8-bit state resumes exactly on 2 ranks (test_resume_same_world_size_is_exact
    includes it) and is refused on 4, by ``dcp.load``'s size check of the absmaxes, [S, B]; an
    8-bit checkpoint of unsharded params does not load into FSDP2 params: ``dcp.load`` refuses the
    codes' shape (their trailing dimension of 1), a full state dict our load_state_dict."""
    assert "fused_adam/state_8bit" in runs["resume2"][0]["runs"]
    for phase in ("resume2", "resume4"):
        for r, result in enumerate(runs[phase]):
            refused = result["refused"]
            if phase == "resume4":
                assert "Size mismatch between saved torch.Size([2, 1]) and current: torch.Size([4, 1]) for " \
                    "optim.state.0.weight.exp_avg_absmax" in refused["fused_adam/state_8bit/reshard"], (r, refused)
                assert "fused_adam/state_8bit" not in result["runs"]
            assert "Size mismatch between saved torch.Size([10, 6, 1]) and current: torch.Size([10, 6])" \
                in refused["8bit/dcp.load"], (r, refused)
            assert "8-bit 'exp_avg' without the 'block_layout' that codes blocked per shard come with (codes of the " \
                "whole tensor, as an unsharded or full state dict holds them), but the param is sharded" \
                in refused["8bit/full_state_dict"], \
                (r, refused)


@pytest.mark.slow
def test_a_group_option_the_checkpoint_lacks_is_refused_by_dcp(runs):
    """``dcp.load`` loads every key of the state dict it fills, the groups' options included: an
    optimizer made with ``state_dtype`` does not load a checkpoint whose groups had none (ours
    hold the key only when set). The documented way: make it as saved, set the option after."""
    for r, result in enumerate(runs["resume2"]):
        message = result["refused"]["state_dtype/dcp.load"]
        assert "Missing key in checkpoint state_dict: optim.param_groups.0.state_dtype" in message, (r, message)


@pytest.mark.slow
def test_elementwise_sharded_runs_are_the_unsharded_run(runs):
    """The premise of the resharding check: on 2 ranks, the uninterrupted elementwise runs equal
    the unsharded ones (else equality after resharding would prove nothing about the load)."""
    saved = runs["save2"][0]
    checked = [case for case in saved["runs"] if not any(word in case for word in SHARD_DEPENDENT)]
    assert len(checked) >= 11 and sum("stochastic" in case for case in checked) == 3
    for case in checked:
        _assert_equal(saved["runs"][case]["params"], saved["whole"][case], f"{case}: param")


@pytest.mark.slow
def test_layerwise_runs_are_the_unsharded_run_within_rounding(runs):
    """LARS and FusedLAMB take the norms of the whole tensors (summed from the shards, the only
    difference an order of float64 sums), so the run on 2 ranks and the one resumed on 4 are the
    unsharded run to within LAYERWISE_TOL."""
    saved = runs["save2"][0]
    for case in LAYERWISE:
        for what, run in (("2 ranks", saved["runs"][case]), ("resumed on 4 ranks", runs["resume4"][0]["runs"][case])):
            for fqn, whole in saved["whole"][case].items():
                torch.testing.assert_close(run["params"][fqn], whole, **LAYERWISE_TOL,
                                           msg=lambda m: f"{case}, {what}, {fqn}: {m}")
