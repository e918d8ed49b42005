"""DeepSpeed's own CPU Adam test for 16-bit params (tests/unit/ops/adam/test_cpu_adam.py,
``test_fused_adam_equal``), in our words, on the plain class: ``DeepSpeedCPUAdam`` keeps fp32
optimizer state for fp16/bf16 params by default (``fp32_optimizer_states=True``), which is our
``FusedAdam(..., state_dtype=torch.float32)``. At DeepSpeed's sizes, 10 steps on normal grads from
normal params; the params must agree with an fp32 AdamW run within DeepSpeed's check (the norms
within 1e-2 of each other, relatively). Beyond it: the moments are fp32 tensors holding what
torch's fp32 AdamW holds for the same (16-bit) grads, to fp32 rounding (the moments depend on the
grads alone; only fused multiply-adds differ, a few ulps over 10 steps), where 16-bit state would
be 2^-8 (bf16) or 2^-11 (fp16) off."""

import pytest
import torch

import fused_optim

SIZES = [64, 22, 55, 128, 1024, 1048576]  # DeepSpeed's


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("model_size", SIZES)
def test_16bit_params_with_fp32_state_match_fp32_adamw(model_size, dtype):
    gen = torch.Generator().manual_seed(model_size)
    ours = torch.nn.Parameter(torch.randn(model_size, generator=gen).to(dtype))
    theirs = torch.nn.Parameter(ours.detach().float())
    opt = fused_optim.FusedAdam([ours], fused=True, state_dtype=torch.float32)
    reference = torch.optim.AdamW([theirs], lr=1e-3, weight_decay=0.01)  # FusedAdam's defaults
    for _ in range(10):
        ours.grad = torch.randn(model_size, generator=gen).to(dtype)
        theirs.grad = ours.grad.float()
        opt.step()
        reference.step()
    assert opt.implementation == "fused"
    norm = float(theirs.detach().norm())
    assert abs(float(ours.detach().float().norm()) - norm) <= 1e-2 * norm  # DeepSpeed's check
    eps = torch.finfo(torch.float32).eps
    for key in ("exp_avg", "exp_avg_sq"):
        mine, torch_s = opt.state[ours][key], reference.state[theirs][key]
        assert mine.dtype == torch.float32
        torch.testing.assert_close(mine, torch_s, rtol=20 * eps, atol=20 * eps * float(torch_s.abs().max()))
