"""Subprocess side of tests/mmengine_optim/test_mmengine_fsdp.py, one rank of
``torchrun --nproc_per_node=2 mmengine_fsdp_worker.py OUT``: ``python -m mmengine_optim.train``'s
``main`` on configs/fsdp/digits_fsdp_fused_adam.py (mmengine's FSDPStrategy, FlexibleRunner) for
4 iterations (``fsdp``: mmengine's default ``use_orig_params=True``, the optimizer gets the
model's own params, views of the flat shards; ``fsdp_flat_params``: ``use_orig_params=False``,
the flat shards), then the same config as DDP (``ddp``: ``strategy=None``, mmengine's Runner).
Saves ``OUT/<run>-rank<r>.pt`` for each run: ``{"runner", "optimizer", "implementation",
"warnings", "state_dict", "stepped"}`` (the model's whole state dict, FSDP's gathered; how many
tensors the optimizer holds). Last, the config with FusedLAMB in place of FusedAdam
(``fsdp_lamb``), which must refuse FSDP1's params: ``OUT/fsdp_lamb-rank<r>.txt`` holds the error."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullStateDictConfig, FullyShardedDataParallel, StateDictType

from fused_optim.process_group import end_process_group
from mmengine_optim.train import main as train

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "fsdp" / "digits_fsdp_fused_adam.py"
ITERS = 4


def run(out: Path, name: str, *options: str) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runner = train([str(CONFIG), "--launcher", "pytorch", "--work-dir", str(out / name), "--cfg-options",
                        f"experiment_name={name}", f"train_cfg.max_iters={ITERS}", "train_cfg.val_interval=1000",
                        "log_level=WARNING", "default_hooks.checkpoint.save_last=False", *options])
    model, opt = runner.model, runner.optim_wrapper.optimizer
    if isinstance(model, FullyShardedDataParallel):
        whole = FullStateDictConfig(offload_to_cpu=False, rank0_only=False)
        with FullyShardedDataParallel.state_dict_type(model, StateDictType.FULL_STATE_DICT, whole):
            state = model.state_dict()
    else:
        state = model.module.state_dict()
    torch.save(dict(runner=type(runner).__name__, optimizer=type(opt).__name__, implementation=opt.implementation,
                    warnings=[f"{w.category.__name__}: {w.message}" for w in caught],
                    state_dict={k: v.detach().clone() for k, v in state.items()},
                    stepped=sum(len(group["params"]) for group in opt.param_groups)),
               out / f"{name}-rank{dist.get_rank()}.pt")


def save_init(out: Path) -> Path:
    """One init for both runs (each Runner seeds and builds its model its own way): a
    checkpoint of the config's model as rank 0 made it, which both runs load."""
    from examples.mmengine_digits import DigitsClassifier

    path = out / "init.pth"
    if dist.get_rank() == 0:
        torch.manual_seed(0)
        torch.save(dict(state_dict=DigitsClassifier().state_dict()), path)
    dist.barrier()
    return path


if __name__ == "__main__":
    from fused_optim.process_group import init_process_group

    out = Path(sys.argv[1])
    init_process_group("gloo")
    init = save_init(out)
    run(out, "fsdp", f"load_from={init}", "strategy.state_dict_cfg=full")
    run(out, "fsdp_flat_params", f"load_from={init}", "strategy.state_dict_cfg=full",
        "strategy.model_wrapper.type=MMFullyShardedDataParallel", "strategy.model_wrapper.use_orig_params=False")
    run(out, "ddp", f"load_from={init}", "strategy=None")
    try:  # every rank makes its optimizer at the same point, before any collective of its own
        run(out, "fsdp_lamb", "optim_wrapper.optimizer.type=mmengine_optim.FusedLAMB")
        refusal = "not refused"
    except ValueError as exc:
        refusal = f"ValueError: {exc}"
    (out / f"fsdp_lamb-rank{dist.get_rank()}.txt").write_text(refusal)
    end_process_group()
