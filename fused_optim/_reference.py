"""Pure-PyTorch version of every fused_optim op, with the same signatures as :mod:`._ops`.

Two jobs: the fallback when the kernels cannot be used (unbuildable, non-contiguous or unsupported
tensors), and the test oracle between torch.optim and the kernels (run it on float64 tensors).
Per-tensor math is done in the kernels' math type: fp32 for fp16/bf16 storage, otherwise the
storage type. Results are written back with ``copy_`` into the very tensors passed in, so
non-contiguous params are updated in place, never through a copy.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def _skip(found_inf: Tensor | None) -> bool:
    return found_inf is not None and bool(found_inf.item() != 0)


def _grad_multiplier(grad_scale: Tensor | None, maximize: bool) -> float:
    inv = 1.0 if grad_scale is None else 1.0 / float(grad_scale.item())
    return -inv if maximize else inv


def _opmath(t: Tensor) -> Tensor:
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t.clone()


def sgd_(params, grads, momentum_buffers, first_step, *, lr, momentum, dampening, weight_decay,
         nesterov, maximize, wd_after_momentum, grad_scale=None, found_inf=None) -> None:
    if _skip(found_inf):
        return
    mul = _grad_multiplier(grad_scale, maximize)
    for i, (p, g_in) in enumerate(zip(params, grads)):
        x = _opmath(p)
        g = _opmath(g_in).to(x.dtype) * mul
        if weight_decay != 0 and not wd_after_momentum:
            g = g + weight_decay * x
        if momentum != 0:
            buf = g.clone() if first_step and first_step[i] else momentum * _opmath(momentum_buffers[i]) + (1 - dampening) * g
            momentum_buffers[i].copy_(buf)
            g = g + momentum * buf if nesterov else buf
        if weight_decay != 0 and wd_after_momentum:
            g = g + weight_decay * x
        p.copy_(x - lr * g)


def adam_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, *, lr, beta1, beta2, eps,
          weight_decay, amsgrad, decoupled, maximize, bias_correction=True, grad_scale=None,
          found_inf=None) -> None:
    if _skip(found_inf):
        return
    mul = _grad_multiplier(grad_scale, maximize)
    for i, (p, g_in) in enumerate(zip(params, grads)):
        steps[i].add_(1)
        step = float(steps[i].item())
        bc1 = 1 - beta1**step if bias_correction else 1.0
        bc2 = 1 - beta2**step if bias_correction else 1.0
        x = _opmath(p)
        g = _opmath(g_in).to(x.dtype) * mul
        if weight_decay != 0:
            if decoupled:
                x = x * (1 - lr * weight_decay)
            else:
                g = g + weight_decay * x
        m = _opmath(exp_avgs[i]).lerp(g, 1 - beta1)
        v = _opmath(exp_avg_sqs[i]) * beta2 + (1 - beta2) * g * g
        exp_avgs[i].copy_(m)
        exp_avg_sqs[i].copy_(v)
        if amsgrad:
            v = torch.maximum(_opmath(max_exp_avg_sqs[i]), v)
            max_exp_avg_sqs[i].copy_(v)
        denom = v.sqrt() / math.sqrt(bc2) + eps
        p.copy_(x - (lr / bc1) * m / denom)
