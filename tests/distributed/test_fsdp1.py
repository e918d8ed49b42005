"""FSDP1 (``FullyShardedDataParallel``, ``use_orig_params`` True and False) on 2 gloo ranks
(tests/workers/fsdp1_worker.py): the elementwise optimizers step its params through the kernels
and train as the same model whole, bit for bit; the ones whose rule reads whole tensors (LARS,
LAMB, SparsifiedSGD) refuse its params at construction, saying why and what to use instead; the
marks by which fused_optim/fsdp1.py knows FSDP1's params are still there."""

from __future__ import annotations

import pytest
import torch

import fused_optim
from processes import run_ranks
from utils import WORKERS

WORLD = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp1")
    run_ranks(WORKERS / "fsdp1_worker.py", lambda r: (r, WORLD, tmp), WORLD, tmp)
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def _whole_tensor_rules() -> set[str]:
    return {n for n in fused_optim.list_optimizers() if fused_optim.registry.get_spec(n).cls.whole_tensor_rule}


def test_the_optimizers_that_read_whole_tensors():
    """The rules that a slice of a tensor would change: trust ratios from norms, coordinates per tensor."""
    assert _whole_tensor_rules() == {"colossalai_lamb", "colossalai_lars", "fused_lamb", "lamb", "larc", "lars",
                                     "nvlamb", "sparsified_sgd"}


@pytest.mark.slow
def test_elementwise_optimizers_step_fsdp1_params_fused_and_exact(ranks):
    elementwise = set(fused_optim.list_optimizers()) - _whole_tensor_rules()
    for r, result in enumerate(ranks):
        assert {case.split("/")[0] for case in result["runs"]} == elementwise
        assert len(result["runs"]) == 2 * len(elementwise)  # use_orig_params True and False
        for case, run in result["runs"].items():
            what = f"rank {r}, {case}"
            assert run["implementation"] == "fused", f"{what}: stepped by {run['implementation']}"
            assert not run["warnings"], f"{what} warned: {run['warnings']}"
            for k, (sharded, whole) in enumerate(run["params"]):
                assert torch.equal(sharded, whole), f"{what}: param {k} differs from the whole model's"


@pytest.mark.slow
def test_whole_tensor_rules_refuse_fsdp1_params_at_construction(ranks):
    for r, result in enumerate(ranks):
        assert {case.split("/")[0] for case in result["refused"]} == _whole_tensor_rules()
        for case, message in result["refused"].items():
            name = case.split("/")[0]
            kind = "a param flattened" if case.endswith("True") else "a FlatParameter made"
            assert f"param 0 of group 0 is {kind} by FSDP1" in message, f"rank {r}, {case}: {message}"
            assert "another algorithm" in message
            remedy = "DDP" if name == "sparsified_sgd" else "FSDP2 (torch.distributed.fsdp.fully_shard)"
            assert remedy in message, f"rank {r}, {case}: {message}"


@pytest.mark.slow
def test_gradient_statistics_refuse_fsdp1_params_at_construction(ranks):
    """AdaScale's and NoiseScale's hooks sit on the params, which FSDP1's backward (on the flat
    params) never reaches: they would measure nothing, so they refuse, naming FSDP2 and DDP."""
    for r, result in enumerate(ranks):
        assert set(result["statistics_refused"]) == {f"{cls}/use_orig_params={u}" for cls in ("AdaScale", "NoiseScale")
                                                     for u in (True, False)}
        for case, message in result["statistics_refused"].items():
            kind = "a param flattened" if case.endswith("True") else "a FlatParameter made"
            assert message.startswith(f"{case.split('/')[0]}: param 0 of group 0 is {kind} by FSDP1"), message
            assert "pass module=model, or use DDP" in message, f"rank {r}, {case}: {message}"


@pytest.mark.slow
def test_fsdp1_marks_its_params_as_fused_optim_fsdp1_reads_them(ranks):
    """If this fails, torch changed FSDP1's private marks: update fused_optim/fsdp1.py (which
    names them) and fused_optim/fallback.py's type check (a FlatParameter must stay a plain
    ``nn.Parameter`` to the kernels, or be let through by name)."""
    for r, result in enumerate(ranks):
        for use_orig_params, params in result["marks"].items():
            assert params, f"rank {r}: no params"
            for type_name, flat, flattened, detected in params:
                assert type_name == "Parameter", f"rank {r}: FSDP1 param is a {type_name}"
                assert flattened and detected, f"rank {r}: use_orig_params={use_orig_params}: unmarked param"
                assert flat == (not use_orig_params), f"rank {r}: use_orig_params={use_orig_params}: _is_flat_param"


def test_a_refused_group_leaves_the_optimizer_as_it_was():
    """A group added later is checked too; refused, it is not added (FSDP1's mark, set here by
    hand: the marks test above checks that FSDP1 sets it)."""
    opt = fused_optim.LARS([torch.nn.Parameter(torch.ones(3))], lr=0.1)
    flattened = torch.nn.Parameter(torch.ones(4))
    flattened._fsdp_flattened = True
    with pytest.raises(ValueError, match="LARS: param 0 of group 1 is a param flattened by FSDP1"):
        opt.add_param_group({"params": [flattened]})
    assert len(opt.param_groups) == 1
    fused_optim.FusedAdam([flattened], lr=0.1).add_param_group({"params": [torch.nn.Parameter(torch.ones(2))]})
    stats = fused_optim.AdaScale(fused_optim.FusedSGD([torch.nn.Parameter(torch.ones(3))], lr=0.1), world_size=2)
    with pytest.raises(ValueError, match="AdaScale: param 0 of group 1 is a param flattened by FSDP1"):
        stats.add_param_group({"params": [flattened]})
    assert len(stats.param_groups) == 1 and len(stats._rows) == 1
