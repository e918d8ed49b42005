"""mmengine's FSDPStrategy (FlexibleRunner; torch's FSDP1, each FSDP unit's params flattened and
sharded across the ranks) on 2 gloo ranks (CPU) with our optimizer named in the config:
configs/fsdp/digits_fsdp_fused_adam.py through ``python -m mmengine_optim.train``'s ``main``
(tests/workers/mmengine_fsdp_worker.py under torchrun), 4 iterations, with mmengine's default
``use_orig_params=True`` (the optimizer gets the model's own params, views of the flat shards,
empty on a rank that holds none of their elements) and with ``use_orig_params=False`` (the flat
shards), against the same config as DDP (mmengine's Runner) from the same init.

FusedAdam is elementwise (each element's update reads only that element and its grad), so a
shard of the flat params steps as those elements would whole; FSDP1 averages the ranks' grads as
DDP does ((g0 + g1) / 2 for 2 ranks: halving is exact, two floats sum in either order), and both
forwards see the same whole params: the two runs end bit for bit equal.
"""

from __future__ import annotations

import pytest
import torch

from processes import torchrun
from utils import REPO, WORKERS

FSDP = ("fsdp", "fsdp_flat_params")
RUNS = (*FSDP, "ddp")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("mmengine_fsdp")
    torchrun([str(WORKERS / "mmengine_fsdp_worker.py"), str(out)], REPO)
    return {"out": out, **{run: [torch.load(out / f"{run}-rank{r}.pt", weights_only=True) for r in (0, 1)]
                             for run in RUNS}}


@pytest.mark.slow
@pytest.mark.parametrize("fsdp", FSDP)
def test_fsdp_strategy_steps_fused_and_equals_ddp(runs, fsdp):
    for run in (fsdp, "ddp"):
        for r, result in enumerate(runs[run]):
            what = f"{run}, rank {r}"
            assert result["runner"] == ("Runner" if run == "ddp" else "FlexibleRunner"), what
            # the whole model is one FSDP unit: one flat param, or the model's 6 tensors
            assert result["stepped"] == {"fsdp": 6, "fsdp_flat_params": 1, "ddp": 6}[run], what
            assert result["optimizer"] == "FusedAdam" and result["implementation"] == "fused", what
            fallback = [w for w in result["warnings"]  # ours begin with the optimizer's name
                        if w.split(": ", 1)[1].startswith("FusedAdam") or "reference implementation" in w]
            assert not fallback, f"{what} warned: {fallback}"
    sharded, ddp = runs[fsdp][0]["state_dict"], runs["ddp"][0]["state_dict"]
    assert sharded.keys() == ddp.keys() and len(sharded) == 6
    for key in sharded:
        assert torch.equal(sharded[key], ddp[key]), \
            f"{fsdp}, {key}: differs from DDP by {(sharded[key] - ddp[key]).abs().max()}"
        assert torch.equal(runs[fsdp][1]["state_dict"][key], sharded[key]), f"{fsdp}, {key}: the ranks disagree"


@pytest.mark.slow
def test_fsdp_strategy_refuses_a_layer_wise_optimizer(runs):
    """The config with FusedLAMB: FSDP1's params are slices of flattened tensors, from which
    LAMB's trust ratios would be another algorithm; the optimizer refuses them when it is made,
    on every rank, saying what to use instead."""
    for r in (0, 1):
        refusal = (runs["out"] / f"fsdp_lamb-rank{r}.txt").read_text()
        assert refusal.startswith("ValueError: FusedLAMB: param 0 of group 0 is a param flattened by FSDP1"), refusal
        assert "FSDP2" in refusal and "elementwise optimizer" in refusal, refusal


@pytest.mark.skipif(torch.accelerator.is_available(), reason="the refusal without an accelerator")
def test_mmengine_fsdp_wrapper_refuses_its_default_device_id_on_cpu():
    """mmengine's FSDPStrategy passes ``device_id=int(LOCAL_RANK)``; without an accelerator torch
    refuses it (before any process group is needed), the error docs/frameworks.md quotes and
    ``prepare_cpu_ddp`` avoids with ``device_id='cpu'``."""
    from mmengine.model import MMFullyShardedDataParallel

    with pytest.raises(RuntimeError, match=r"^Cannot access accelerator device when none is available\.$"):
        MMFullyShardedDataParallel(module=torch.nn.Linear(2, 2), device_id=0)


def test_prepare_cpu_ddp_leaves_a_single_process_fsdp_config_alone():
    """``launcher='none'``: nothing to prepare (and no process group started)."""
    from mmengine.config import Config

    from mmengine_optim import prepare_cpu_ddp

    cfg = Config.fromfile(REPO / "configs" / "fsdp" / "digits_fsdp_fused_adam.py")
    assert prepare_cpu_ddp(cfg).strategy == dict(type="FSDPStrategy")
    assert not torch.distributed.is_initialized()
