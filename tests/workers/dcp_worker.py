"""Subprocess side of tests/distributed/test_dcp.py: one gloo rank saving or resuming a
``torch.distributed.checkpoint`` (DCP) checkpoint of an FSDP2 model and our optimizer.

    dcp_worker.py RANK WORLD OUT_DIR save      (2 ranks: K steps, save, K more steps)
    dcp_worker.py RANK WORLD OUT_DIR resume    (any world size: a fresh model and optimizer, load, K steps)

Every case trains the MLP of tests/fsdp2_mlp.py under ``fully_shard``, with state dicts
from ``get_model_state_dict`` / ``get_optimizer_state_dict`` and ``set_*``, saved and loaded by
``dcp.save`` / ``dcp.load`` in OUT_DIR/ckpt/<case> (a full state dict: rank 0's ``torch.save``,
OUT_DIR/ckpt/<case>.pt). The resumed model starts from other values (another seed), so only a
load that restores everything gives the saved run's numbers.

Saved to OUT_DIR/<phase><world>_rank<r>.pt for the test to judge: ``{"runs": {case: {"params":
{fqn: whole tensor}, "state": {fqn: {key: whole tensor}}, "implementation"}}, "whole": {case:
{fqn: tensor}} (save only: the same model unsharded in one process, 2·K steps), "errors": {case:
message}, "refused": {case: message} (resume only: :func:`refusals`)}`` (DTensors made whole with
``full_tensor()``; a case that raises is saved as its message).
"""

from __future__ import annotations

import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy

import fused_optim
from fused_optim.process_group import end_process_group, init_process_group

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: fsdp2_mlp
from fsdp2_mlp import make_mlp, record, train  # noqa: E402

TIMEOUT = timedelta(seconds=120)  # a rank that fails makes the others' collectives fail, not hang
K = 3  # steps before the checkpoint, and after it
BF16 = torch.bfloat16
# case: (registered name, options, param dtype, state dict kind). Every state format a sharded
# param may hold: moments, masters, bf16 moments, rounding keys of the state and of params; state
# dicts of DTensors by FQN ("sharded"), flattened ("flat", torch's flatten_optimizer_state_dict),
# or whole tensors (``full_state_dict``) saved by rank 0 with torch.save and broadcast from it.
CASES = {
    "fused_adam": ("fused_adam", dict(weight_decay=1e-2, amsgrad=True), torch.float32, "sharded"),
    "cpu_adam": ("cpu_adam", dict(weight_decay=1e-2), torch.float32, "sharded"),
    "fused_sgd": ("fused_sgd", dict(momentum=0.9, weight_decay=1e-2), torch.float32, "sharded"),
    "sign_sgd": ("sign_sgd", dict(momentum=0.9), torch.float32, "sharded"),
    "fused_adam/master_weights": ("fused_adam", dict(master_weights=True), BF16, "sharded"),
    "fused_adam/state_bf16": ("fused_adam", dict(state_dtype=BF16), torch.float32, "sharded"),
    "fused_adam/state_bf16_stochastic": ("fused_adam", dict(state_dtype=BF16, state_rounding="stochastic"),
                                         torch.float32, "sharded"),
    "fused_sgd/stochastic_params": ("fused_sgd", dict(momentum=0.9, stochastic_rounding=True), BF16, "sharded"),
    "fused_adam/master_weights_bf16_stochastic/flat": ("fused_adam", dict(master_weights=True, state_dtype=BF16,
                                                                     state_rounding="stochastic"), BF16, "flat"),
    "fused_adam/master_weights_state_bf16/full": ("fused_adam", dict(master_weights=True, state_dtype=BF16), BF16,
                                                  "full"),
    "fused_adam/state_bf16_then_fp32": ("fused_adam", dict(state_dtype=BF16), torch.float32, "sharded"),
    "fused_adam/fp32_then_state_bf16": ("fused_adam", dict(), torch.float32, "sharded"),
    "cpu_adam/cpu_offload": ("cpu_adam", dict(weight_decay=1e-2), torch.float32, "sharded"),
    "fused_adam/state_8bit": ("fused_adam", dict(state_dtype="8bit", amsgrad=True), torch.float32, "sharded"),
    "lars": ("lars", dict(momentum=0.9, weight_decay=1e-2), torch.float32, "sharded"),
    "fused_lamb": ("fused_lamb", dict(weight_decay=1e-2, max_grad_norm=1.0), torch.float32, "sharded"),
}

# Cases whose state is blocked per shard (8-bit: fused_optim/sharded_blocks.py): resumed on the
# world size they were saved on only; on another, the attempt's message is saved under "refused".
PER_SHARD = {"fused_adam/state_8bit"}
# Cases whose model is under FSDP2's CPUOffloadPolicy (pin_memory=False: no accelerator needed)
OFFLOADED = {"cpu_adam/cpu_offload"}
# Cases that go on after the checkpoint with other state options, whose first step converts the
# saved moments: resumed by an optimizer made with other options (LOADED_INTO: the loading
# optimizer's format applies), or by one made as saved whose groups are given the options after
# the load (SET_AFTER: an optimizer made with a state_dtype the checkpoint's groups lack is
# refused by dcp.load, which wants every key of the groups it loads into; see refusals).
LOADED_INTO = {"fused_adam/state_bf16_then_fp32": dict()}
SET_AFTER = {"fused_adam/fp32_then_state_bf16": dict(state_dtype=BF16)}


def shard_options(case: str) -> dict:
    return dict(offload_policy=CPUOffloadPolicy(pin_memory=False)) if case in OFFLOADED else {}


def after_checkpoint(case: str, model, opt):
    """The optimizer the uninterrupted run goes on with: ``opt``; for a case of LOADED_INTO a new
    one with those options given ``opt``'s state by ``load_state_dict``; for one of SET_AFTER
    ``opt`` with those options set on its groups."""
    if case in LOADED_INTO:
        other = fused_optim.create_optimizer(CASES[case][0], model.parameters(), lr=1e-2, **LOADED_INTO[case])
        other.load_state_dict(opt.state_dict())
        return other
    for group in opt.param_groups:
        group.update(SET_AFTER.get(case, {}))
    return opt


def options(kind: str, loading: bool = False) -> StateDictOptions:
    if kind == "full":
        return StateDictOptions(full_state_dict=True, broadcast_from_rank0=True) if loading else \
            StateDictOptions(full_state_dict=True, cpu_offload=True)
    return StateDictOptions(flatten_optimizer_state_dict=kind == "flat")


def state_dicts(model, opt, kind: str) -> dict:
    return {"model": get_model_state_dict(model, options=options(kind)),
            "optim": get_optimizer_state_dict(model, opt, options=options(kind))}


def save(model, opt, kind: str, ckpt: Path) -> None:
    """``dcp.save`` of the state dicts; a full state dict is rank 0's ``torch.save``."""
    state = state_dicts(model, opt, kind)
    if kind != "full":
        dcp.save(state, checkpoint_id=ckpt)
    elif dist.get_rank() == 0:
        ckpt.parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, ckpt.with_suffix(".pt"))


def load(model, opt, kind: str, ckpt: Path) -> None:
    """``dcp.load`` into the fresh model's and optimizer's state dicts, then ``set_*_state_dict``; a
    full state dict is read by rank 0 and broadcast from it."""
    if kind != "full":
        state = state_dicts(model, opt, kind)
        dcp.load(state, checkpoint_id=ckpt)
    else:
        state = torch.load(ckpt.with_suffix(".pt"), weights_only=True) if dist.get_rank() == 0 else \
            {"model": {}, "optim": {}}
    set_model_state_dict(model, state["model"], options=options(kind, loading=True))
    set_optimizer_state_dict(model, opt, state["optim"], options=options(kind, loading=True))


def save_case(case: str, mesh, ckpt: Path) -> tuple[dict, dict]:
    """K steps, the checkpoint, K more steps (the uninterrupted run); and the same 2·K steps unsharded."""
    name, kwargs, dtype, kind = CASES[case]
    model = make_mlp(0, dtype, mesh, **shard_options(case))
    opt = fused_optim.create_optimizer(name, model.parameters(), lr=1e-2, **kwargs)
    train(model, opt, range(K), dtype)
    save(model, opt, kind, ckpt)
    dist.barrier()  # (a full state dict: rank 0 wrote it before any rank resumes)
    opt = after_checkpoint(case, model, opt)
    train(model, opt, range(K, 2 * K), dtype)
    plain = make_mlp(0, dtype)
    plain_opt = fused_optim.create_optimizer(name, plain.parameters(), lr=1e-2, **kwargs)
    train(plain, plain_opt, range(K), dtype)
    plain_opt = after_checkpoint(case, plain, plain_opt)
    train(plain, plain_opt, range(K, 2 * K), dtype)
    return record(model, opt), record(plain, plain_opt)["params"]


def resume_case(case: str, mesh, ckpt: Path) -> dict:
    """A fresh model (other values) and optimizer, the checkpoint loaded into them, K steps."""
    name, kwargs, dtype, kind = CASES[case]
    model = make_mlp(1, dtype, mesh, **shard_options(case))
    opt = fused_optim.create_optimizer(name, model.parameters(), lr=1e-2, **LOADED_INTO.get(case, kwargs))
    load(model, opt, kind, ckpt)
    for group in opt.param_groups:
        group.update(SET_AFTER.get(case, {}))
    train(model, opt, range(K, 2 * K), dtype)
    return record(model, opt)


def save_8bit_unsharded(ckpt: Path) -> None:
    """A checkpoint of 8-bit state of the MLP unsharded (the same on every rank, as under DDP):
    ``dcp.save`` in ``ckpt``, and rank 0's ``torch.save`` of the same state dict in ``ckpt``.pt."""
    model = make_mlp(0, torch.float32)
    opt = fused_optim.create_optimizer("fused_adam", model.parameters(), lr=1e-2, state_dtype="8bit")
    train(model, opt, range(K), torch.float32)
    state = {"optim": get_optimizer_state_dict(model, opt)}
    dcp.save(state, checkpoint_id=ckpt)
    if dist.get_rank() == 0:
        torch.save(state, ckpt.with_suffix(".pt"))


def refusals(mesh, ckpts: Path) -> dict[str, str]:
    """What is refused (case: message): the unsharded 8-bit checkpoint loaded by ``dcp.load``, and as
    a full state dict, into an FSDP2 optimizer with bf16 state; a checkpoint of fp32 state loaded
    by ``dcp.load`` into an optimizer made with ``state_dtype`` (its groups' key is not saved)."""
    ckpt = ckpts / "8bit-unsharded"

    def sharded_opt(state_dtype):
        model = make_mlp(1, torch.float32, mesh)
        return model, fused_optim.create_optimizer("fused_adam", model.parameters(), lr=1e-2, state_dtype=state_dtype)

    def dcp_load():
        model, opt = sharded_opt(torch.bfloat16)
        dcp.load({"optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=ckpt)

    def full_load():
        model, opt = sharded_opt(torch.bfloat16)
        full = torch.load(ckpt.with_suffix(".pt"), weights_only=True)["optim"]
        set_optimizer_state_dict(model, opt, full, options=StateDictOptions(full_state_dict=True))

    def group_key_missing():
        model, opt = sharded_opt(torch.bfloat16)
        saved_without = ckpts / "fused_adam-fp32_then_state_bf16"
        dcp.load({"optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=saved_without)

    messages = {}
    for case, attempt in (("8bit/dcp.load", dcp_load),
                          ("8bit/full_state_dict", full_load), ("state_dtype/dcp.load", group_key_missing)):
        try:
            attempt()
            messages[case] = "nothing raised"
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 (DCP's is a BaseException; for the test)
            messages[case] = f"{type(exc).__name__}: {exc}"
    return messages


def main(rank: int, world: int, out_dir: str, phase: str) -> None:
    torch.set_num_threads(1)
    init_process_group("gloo", init_method=f"file://{out_dir}/store_{phase}{world}", rank=rank, world_size=world,
                       timeout=TIMEOUT)
    mesh = init_device_mesh("cpu", (world,))
    result = {"runs": {}, "whole": {}, "errors": {}, "refused": {}}
    for case in CASES:
        ckpt = Path(out_dir) / "ckpt" / case.replace("/", "-")
        try:
            if phase == "save":
                result["runs"][case], result["whole"][case] = save_case(case, mesh, ckpt)
            else:
                result["runs"][case] = resume_case(case, mesh, ckpt)
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 (saved for the test, which judges it)
            message = f"{type(exc).__name__}: {exc}"
            if phase == "resume" and world != 2 and case in PER_SHARD:
                result["refused"][f"{case}/reshard"] = message
            else:
                result["errors"][case] = f"{message}\n{traceback.format_exc(limit=6)}"
    if phase == "save":
        save_8bit_unsharded(Path(out_dir) / "ckpt" / "8bit-unsharded")
    else:
        result["refused"].update(refusals(mesh, Path(out_dir) / "ckpt"))
    torch.save(result, Path(out_dir) / f"{phase}{world}_rank{rank}.pt")
    end_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
