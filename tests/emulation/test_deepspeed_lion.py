"""DeepSpeed's own CPU Lion test (tests/unit/ops/lion/test_cpu_lion.py, ``test_fused_lion_equal``),
in our words, with our Lion in place of DeepSpeed's two: the CPU kernels for ``DeepSpeedCPULion``
and the CUDA kernels (on a GPU, and everywhere under the CUDA emulation) for ``FusedLion``. Both at
their defaults start from the same normal fp16 or fp32 params, take 10 steps on the same normal
grads, and the params' norms must agree within 1% of the CPU params' norm (DeepSpeed's check), at
DeepSpeed's sizes. Ours is checked tighter too: the two devices run one rule (csrc/shared/lion_math.h)
with the same fused multiply-adds, so every element and the momentum agree bit for bit (where the
CPU kernels have FMA, as every AVX2 CPU).

Not adapted: ``test_cpu_lion_gpu_error`` (DeepSpeed's CPU op raises on a GPU param; ours steps CUDA
params with its CUDA kernels) and tests/unit/ops/lion/test_lion.py (which optimizer class
DeepSpeed's engine picks for a config: DeepSpeed's own machinery)."""

import pytest
import torch

import fused_optim
from test_cuda import backend  # noqa: F401  (the GPU and emulated backends)
from utils import cpu_kernels_fuse_multiply_adds

SIZES = [64, 22, 128, 1024, 1048576]  # DeepSpeed's


@pytest.mark.parametrize("dtype", [torch.half, torch.float], ids=["fp16", "fp32"])
@pytest.mark.parametrize("model_size", SIZES)
def test_lion_on_the_cpu_equals_lion_on_cuda(backend, model_size, dtype):  # noqa: F811
    gen = torch.Generator().manual_seed(model_size)
    cpu_param = torch.nn.Parameter(torch.randn(model_size, generator=gen).to(dtype))
    start = cpu_param.detach().clone()
    device_param = torch.nn.Parameter(cpu_param.detach().to(backend.device, copy=True))
    cpu_opt, device_opt = fused_optim.Lion([cpu_param], fused=True), fused_optim.Lion([device_param], fused=True)
    for _ in range(10):
        cpu_param.grad = torch.randn(model_size, generator=gen).to(dtype)
        device_param.grad = cpu_param.grad.to(backend.device, copy=True)
        cpu_opt.step()
        with backend.context():
            device_opt.step()
    assert cpu_opt.implementation == device_opt.implementation == "fused"
    cpu_norm, device_norm = cpu_param.detach().float().norm(), device_param.detach().float().cpu().norm()
    torch.testing.assert_close(device_norm, cpu_norm, rtol=0, atol=float(cpu_norm) * 1e-2)  # DeepSpeed's check
    assert not torch.equal(cpu_param.detach(), start)
    if cpu_kernels_fuse_multiply_adds():
        assert torch.equal(device_param.detach().cpu(), cpu_param.detach())
        assert torch.equal(device_opt.state[device_param]["exp_avg"].cpu(), cpu_opt.state[cpu_param]["exp_avg"])
