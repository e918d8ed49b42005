"""Subprocess side of tests/distributed/test_cpu_offload.py: one rank training FSDP2 models with
``CPUOffloadPolicy`` and our CPU optimizers.

    offload_worker.py RANK WORLD OUT_DIR [DEVICE]   (all ranks at once; they meet through OUT_DIR/store)

DEVICE is the mesh's: ``cpu`` (default; gloo, ``CPUOffloadPolicy(pin_memory=False)``) or ``cuda``
(NCCL only, one GPU per rank, ``CPUOffloadPolicy()``: the shards on the CPU of a CUDA mesh, whose
group takes CUDA tensors only, so the optimizers' collectives must run on the GPU).

Every case trains the MLP of tests/fsdp2_mlp.py twice from the same values: under
``fully_shard(..., offload_policy=...)`` and under plain ``fully_shard``, with the same optimizer,
and records both; AdaScale given the model (``adascale/fused_adam``, two micro-batches a step) also
its gains. On a machine without an accelerator it also records what ``CPUOffloadPolicy()``
(``pin_memory=True``, its default) raises.

Saved to OUT_DIR/rank<r>.pt for the test to judge: ``{"runs": {case: {"offloaded", "resident":
fsdp2_mlp.record(...) (and "gains"), "devices": sorted device types of the offloaded params, grads
and state, "dtensor_state": whether every non-scalar state tensor is a DTensor, "warnings"}},
"errors": {case: message}, "pinned_error": message or None}``.
"""

from __future__ import annotations

import os
import sys
import traceback
import warnings
from datetime import timedelta
from pathlib import Path

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

import fused_optim
from fused_optim.process_group import end_process_group, init_process_group

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: fsdp2_mlp
from fsdp2_mlp import batch, make_mlp, record, train  # noqa: E402

TIMEOUT = timedelta(seconds=120)  # a rank that fails makes the others' collectives fail, not hang
STEPS = 3
BF16 = torch.bfloat16
# case: (registered name, options, param dtype, fully_shard options besides the offload policy)
COMPUTE_IN_BF16 = dict(mp_policy=MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32))
CASES = {
    "fused_adam": ("fused_adam", dict(weight_decay=1e-2), torch.float32, {}),
    "cpu_adam": ("cpu_adam", dict(weight_decay=1e-2), torch.float32, {}),
    "fused_lamb": ("fused_lamb", dict(weight_decay=1e-2), torch.float32, {}),
    "fused_adam/state_bf16": ("fused_adam", dict(state_dtype=BF16), torch.float32, {}),
    "fused_lamb/state_bf16": ("fused_lamb", dict(weight_decay=1e-2, state_dtype=BF16), torch.float32, {}),
    "cpu_adam/master_weights": ("cpu_adam", dict(master_weights=True), BF16, {}),
    "fused_lamb/master_weights": ("fused_lamb", dict(master_weights=True), BF16, {}),
    # ZeRO-Offload's setting: fp32 params offloaded, forward and backward in bf16
    "fused_adam/mixed_precision": ("fused_adam", dict(weight_decay=1e-2), torch.float32, COMPUTE_IN_BF16),
    # the statistics' micro-batch sums on the compute device, the .grad sums on the CPU
    "adascale/fused_adam": ("fused_adam", dict(adascale=True), torch.float32, {}),
}
ACCUM = 2  # AdaScale's micro-batches per step
# On a GPU mesh, the fp32 cases (what runs where, and the collectives' devices; the CPU kernels
# against the CUDA ones, which differ by ulps, and a 16-bit rounding flipped by them would not).
# CPUAdam steps CPU params only: there is no resident run of it on a GPU.
GPU_CASES = ("fused_adam", "fused_lamb", "fused_adam/mixed_precision", "adascale/fused_adam")


def devices(model, opt) -> list[str]:
    """The device types of the local tensors of the params, their grads and their state."""
    tensors = []
    for p in model.parameters():
        tensors += [p, p.grad, *(v for v in opt.state[p].values() if isinstance(v, torch.Tensor))]
    return sorted({(t.to_local() if isinstance(t, DTensor) else t).device.type for t in tensors if t is not None})


def train_adascale(model, opt) -> list[float]:
    """STEPS steps of ACCUM micro-batches each; the gain after each step."""
    gains = []
    for k in range(STEPS):
        for micro in range(ACCUM):
            model(batch(ACCUM * k + micro, torch.float32)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        gains.append(opt.gain())
    return gains


def run(case: str, mesh) -> dict:
    name, kwargs, dtype, shard_options = CASES[case]
    kwargs = dict(kwargs)
    adascale = kwargs.pop("adascale", False)
    out = {}
    offload = CPUOffloadPolicy(pin_memory=mesh.device_type != "cpu")  # (pinned memory needs an accelerator)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for kind, policy in (("offloaded", dict(offload_policy=offload)), ("resident", {})):
            model = make_mlp(0, dtype, mesh, **shard_options, **policy)
            opt = fused_optim.create_optimizer(name, model.parameters(), lr=1e-2, **kwargs)
            if adascale:
                opt = fused_optim.AdaScale(opt, num_gradients_to_accumulate=ACCUM, module=model)
                gains = train_adascale(model, opt)
            else:
                train(model, opt, range(STEPS), dtype)
            if kind == "offloaded":
                out["devices"] = devices(model, opt)
                out["dtensor_state"] = all(isinstance(v, DTensor) for st in opt.state.values() for v in st.values()
                                           if isinstance(v, torch.Tensor) and v.dim() > 0)
            out[kind] = record(model, opt)
            if adascale:
                out[kind]["gains"] = gains
    out["warnings"] = [str(w.message) for w in caught]
    return out


def pinned_error(mesh) -> str | None:
    """What ``fully_shard`` with ``CPUOffloadPolicy()`` (pinned memory) raises here, None if nothing."""
    try:
        make_mlp(0, torch.float32, mesh, offload_policy=CPUOffloadPolicy())
    except RuntimeError as exc:
        return str(exc)
    return None


def main(rank: int, world: int, out_dir: str, device: str = "cpu") -> None:
    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(rank)
    init_process_group("gloo" if device == "cpu" else "nccl", init_method=f"file://{out_dir}/store", rank=rank,
                       world_size=world, timeout=TIMEOUT)
    mesh = init_device_mesh(device, (world,))
    result = {"runs": {}, "errors": {}, "pinned_error": None}
    for case in CASES if device == "cpu" else GPU_CASES:
        try:
            result["runs"][case] = run(case, mesh)
        except Exception as exc:  # noqa: BLE001 (saved for the test, which says what was expected)
            result["errors"][case] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=6)}"
    if not torch.accelerator.is_available():
        result["pinned_error"] = pinned_error(mesh)
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    end_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:])
