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


def _lr(lr: float, lr_tensor: Tensor | None) -> float:
    """The op's learning rate: ``lr_tensor``'s value when given (see :mod:`._ops`), else ``lr``."""
    return lr if lr_tensor is None else float(lr_tensor.item())


def _grad_multiplier(grad_scale: Tensor | None, maximize: bool) -> float:
    inv = 1.0 if grad_scale is None else 1.0 / float(grad_scale.item())
    return -inv if maximize else inv


def _opmath(t: Tensor) -> Tensor:
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t.clone()


def _norm(t: Tensor) -> float:
    return float(torch.linalg.vector_norm(t, dtype=torch.float64))


def _sum_of_squares(t: Tensor) -> Tensor:
    return torch.linalg.vector_norm(t, dtype=torch.float64).square()


def _check_norm_sums(norm_sums: Tensor | None, sums_only: bool, params) -> None:
    """The layer-wise ops' ``norm_sums`` / ``sums_only`` (the sharded step's two calls, see
    :mod:`._ops`): none (then not ``sums_only``), or a contiguous float64 [n, 2] tensor on the
    params' device, one row per param."""
    if norm_sums is None:
        if sums_only:
            raise ValueError("sums_only=True needs norm_sums, the float64 [n, 2] tensor it writes the "
                             "per-tensor sums to")
        return
    n = len(params)
    if (norm_sums.dtype != torch.float64 or tuple(norm_sums.shape) != (n, 2) or not norm_sums.is_contiguous()
            or (params and norm_sums.device != params[0].device)):
        raise ValueError(f"norm_sums must be a contiguous float64 tensor of shape [{n}, 2] (one row per param) "
                         f"on the params' device; got {norm_sums.dtype} of shape {list(norm_sums.shape)} on "
                         f"{norm_sums.device}")


def _layer_norms(params, grads, norm_sums: Tensor | None) -> list[tuple[float, float]]:
    """Per tensor (‖p‖, ‖g‖): of the tensors, or the square roots of the sums given in
    ``norm_sums`` (sharded params: the sums over the whole tensors)."""
    if norm_sums is None:
        return [(_norm(p), _norm(g)) for p, g in zip(params, grads)]
    return [(math.sqrt(sp), math.sqrt(sg)) for sp, sg in norm_sums.tolist()]


def _write_sums(norm_sums: Tensor, pairs) -> None:
    """Row i of ``norm_sums`` := (Σv², Σx²) in float64 of the i-th pair (v, x)."""
    for i, (v, x) in enumerate(pairs):
        norm_sums[i] = torch.stack([_sum_of_squares(v), _sum_of_squares(x)])


def _sgd_family(params, grads, momentum_buffers, first_step, *, grad_mul, weight_decay, lr, momentum, dampening,
                nesterov, wd_after_momentum=False, direction="plain", clamp=0.0) -> None:
    """The SGD family (see csrc/shared/sgd_math.h): per-tensor grad_mul, weight_decay and lr lists;
    direction "plain", "sign" (SignSGD) or "clamp" (d clamped to [-clamp, clamp] before momentum)."""
    for i, (p, g_in) in enumerate(zip(params, grads)):
        x = _opmath(p)
        d = _opmath(g_in).to(x.dtype) * grad_mul[i]
        if weight_decay[i] != 0 and not wd_after_momentum:
            d = d + weight_decay[i] * x
        if direction == "clamp":
            d = d.clamp(-clamp, clamp)
        if momentum != 0:
            buf = d.clone() if first_step and first_step[i] else momentum * _opmath(momentum_buffers[i]) + (1 - dampening) * d
            momentum_buffers[i].copy_(buf)
            d = d + momentum * buf if nesterov else buf
        if weight_decay[i] != 0 and wd_after_momentum:
            d = d + weight_decay[i] * x
        p.copy_(x - lr[i] * (d.sign() if direction == "sign" else d))


def sgd_(params, grads, momentum_buffers, first_step, *, lr, momentum, dampening, weight_decay,
         nesterov, maximize, wd_after_momentum, lr_tensor=None, grad_scale=None, found_inf=None) -> None:
    if _skip(found_inf):
        return
    lr = _lr(lr, lr_tensor)
    n = len(params)
    _sgd_family(params, grads, momentum_buffers, first_step, grad_mul=[_grad_multiplier(grad_scale, maximize)] * n,
                weight_decay=[weight_decay] * n, lr=[lr] * n, momentum=momentum, dampening=dampening,
                nesterov=nesterov, wd_after_momentum=wd_after_momentum)


def sign_sgd_(params, grads, momentum_buffers, first_step, *, lr, momentum, dampening, weight_decay, nesterov,
              lr_tensor=None, grad_scale=None, found_inf=None) -> None:
    if _skip(found_inf):
        return
    lr = _lr(lr, lr_tensor)
    n = len(params)
    _sgd_family(params, grads, momentum_buffers, first_step, grad_mul=[_grad_multiplier(grad_scale, False)] * n,
                weight_decay=[weight_decay] * n, lr=[lr] * n, momentum=momentum, dampening=dampening,
                nesterov=nesterov, direction="sign")


def lars_(params, grads, momentum_buffers, first_step, *, lr, momentum, dampening, weight_decay, nesterov,
          trust_coefficient, eps, trust_clip, always_adapt, norm_sums=None, sums_only=False, lr_tensor=None,
          grad_scale=None, found_inf=None) -> None:
    _check_norm_sums(norm_sums, sums_only, params)
    if _skip(found_inf):
        return
    if sums_only:  # (Σp², Σg²) of the grads as stored, nothing else written
        return _write_sums(norm_sums, zip(params, grads))
    lr = _lr(lr, lr_tensor)
    inv = _grad_multiplier(grad_scale, False)
    grad_mul, decay = [], []
    for pn, stored_gn in _layer_norms(params, grads, norm_sums):
        gn = stored_gn * inv
        r = 1.0
        adapt = (weight_decay != 0 or always_adapt) and pn > 0 and gn > 0
        if adapt:
            r = trust_coefficient * pn / (gn + weight_decay * pn + eps)
            if trust_clip:
                r = min(r / lr if lr != 0 else math.inf, 1.0)
        grad_mul.append(inv * r)
        decay.append(weight_decay * r if adapt else 0.0)
    _sgd_family(params, grads, momentum_buffers, first_step, grad_mul=grad_mul, weight_decay=decay,
                lr=[lr] * len(params), momentum=momentum, dampening=dampening, nesterov=nesterov)


def colossal_lars_(params, grads, momentum_buffers, first_step, *, lr, momentum, eeta, weight_decay, epsilon, lars,
                   norm_sums=None, sums_only=False, lr_tensor=None, grad_scale=None, found_inf=None) -> None:
    _check_norm_sums(norm_sums, sums_only, params)
    if _skip(found_inf):
        return
    if sums_only:  # (Σp², Σg²) of the grads as stored, nothing else written
        return _write_sums(norm_sums, zip(params, grads))
    lr = _lr(lr, lr_tensor)
    inv = _grad_multiplier(grad_scale, False)
    rates = []
    for pn, stored_gn in _layer_norms(params, grads, norm_sums):
        gn = stored_gn * inv
        r = eeta * pn / (gn + weight_decay * pn + epsilon) if lars and pn > 0 and gn > 0 else 1.0
        rates.append(lr * min(max(r, 0.0), 50.0))
    n = len(params)
    _sgd_family(params, grads, momentum_buffers, first_step, grad_mul=[inv] * n,
                weight_decay=[weight_decay if lars else 0.0] * n, lr=rates, momentum=momentum, dampening=0.0,
                nesterov=False, direction="clamp", clamp=10.0)


def sparse_indices(d: int, k: int, random_sparse: bool, generator=None) -> torch.Tensor:
    """The flat indices of the k coordinates sparsified SGD sends from a tensor of d elements (the
    draws of csrc/host/sparse_indices.h): randperm(d)[:k], or the block [b·k, min(b·k + k, d))
    with b uniform in [0, ⌈d/k⌉); k is clamped to d, and an empty tensor draws nothing."""
    k = min(k, d)  # k >= d sends every coordinate
    if d == 0:
        return torch.empty(0, dtype=torch.long)  # nothing to send, nothing drawn
    if random_sparse:
        return torch.randperm(d, generator=generator)[:k]
    start = int(torch.randint(-(-d // k), (1,), generator=generator)) * k
    return torch.arange(start, min(start + k, d))


def indices_in_box(index: torch.Tensor, local_shape, whole_shape, offsets) -> torch.Tensor:
    """The flat indices ``index`` of a tensor of ``whole_shape`` that lie in the box of
    ``local_shape`` at ``offsets``, as flat indices of the box (csrc/host/sparse_indices.h)."""
    coordinates = torch.stack(torch.unravel_index(index, tuple(whole_shape))) if len(whole_shape) else \
        index.new_zeros(0, index.numel())
    local = coordinates - torch.tensor(list(offsets), dtype=torch.long).view(-1, 1)
    sizes = torch.tensor(list(local_shape), dtype=torch.long).view(-1, 1)
    inside = ((local >= 0) & (local < sizes)).all(dim=0)
    strides = torch.tensor([math.prod(local_shape[d + 1:]) for d in range(len(local_shape))], dtype=torch.long)
    return (local * strides.view(-1, 1)).sum(dim=0)[inside]


def _sparse_boxes(params, whole_shapes, box_offsets) -> list:
    """Each param's (whole shape, box offsets) from the op's concatenated lists (None: a whole
    tensor), checked before anything is written."""
    if not whole_shapes and not box_offsets:
        return [None] * len(params)
    dims = sum(p.dim() for p in params)
    if not len(whole_shapes) == len(box_offsets) == dims:
        raise ValueError(f"sparsified_sgd_: whole_shapes and box_offsets need one entry per dimension of each param, "
                         f"or none ({len(whole_shapes)} and {len(box_offsets)} for {dims} dimensions)")
    boxes, at = [], 0
    for t, p in enumerate(params):
        whole, offsets = list(whole_shapes[at:at + p.dim()]), list(box_offsets[at:at + p.dim()])
        at += p.dim()
        if not all(0 <= o and o + n <= w for o, n, w in zip(offsets, p.shape, whole)):
            raise ValueError(f"sparsified_sgd_: param {t} ({list(p.shape)}) at box_offsets {offsets} does not lie in "
                             f"its whole tensor {whole}")
        boxes.append((whole, offsets))
    return boxes


def sparsified_sgd_(params, grads, memories, *, lr, weight_decay, sparse_grad_size, random_sparse, generator=None,
                    whole_shapes=(), box_offsets=(), lr_tensor=None, grad_scale=None, found_inf=None) -> None:
    """Error feedback with k coordinates per tensor (see csrc/cpu/sparsified_sgd.cpp; same draws;
    ``whole_shapes``/``box_offsets``: params that are boxes of those whole tensors)."""
    if _skip(found_inf):
        return
    lr = _lr(lr, lr_tensor)
    mul = lr * _grad_multiplier(grad_scale, False)
    boxes = _sparse_boxes(params, whole_shapes, box_offsets)
    for p, g, memory, box in zip(params, grads, memories, boxes):
        if box is None:
            index = sparse_indices(p.numel(), sparse_grad_size, random_sparse, generator)
        else:
            whole = sparse_indices(math.prod(box[0]), sparse_grad_size, random_sparse, generator)
            index = indices_in_box(whole, p.shape, *box)
        memory.copy_(_opmath(memory) + mul * _opmath(g).to(_opmath(memory).dtype))
        x = _opmath(p)
        p.copy_(x - weight_decay * x)
        where = torch.unravel_index(index, p.shape)  # in place, also for a non-contiguous param
        p[where] = (_opmath(p[where]) - _opmath(memory[where])).to(p.dtype)
        memory[where] = 0


def adam_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, *, lr, beta1, beta2, eps,
          weight_decay, amsgrad, decoupled, maximize, bias_correction=True, div_scale=1.0, lr_tensor=None,
          grad_scale=None, found_inf=None) -> None:
    if _skip(found_inf):
        return
    lr = _lr(lr, lr_tensor)
    mul = _grad_multiplier(grad_scale, maximize) / div_scale
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


def _lamb(params, grads, exp_avgs, exp_avg_sqs, steps, per_tensor, *, grad_mul, beta1, beta2, beta3, eps,
          weight_decay, decoupled, trust_ratio, trust_clip, settle, norm_sums, sums_only) -> None:
    """LAMB (see csrc/cpu/lamb.cpp): ``per_tensor(step) -> (c1, c2, lr)``. The trust ratio's ||u||
    is taken from the new moments in the math type, the update from the moments as stored (the
    kernel's two passes): rounded to the state's dtype, or with compact state encoded (``settle``,
    OpSpec.run_compact_reference) and decoded. Without the trust ratio (one pass) u is that of
    the new moments in the math type. ``sums_only``: (Σx², Σu²) into ``norm_sums`` and nothing
    else written; else the trust ratio's norms from ``norm_sums`` when given."""
    sums = []  # sums_only: (x, u) per tensor
    for i, (p, g_in) in enumerate(zip(params, grads)):
        if sums_only:
            step = float(steps[i].item()) + 1
        else:
            steps[i].add_(1)
            step = float(steps[i].item())
        c1, c2, lr = per_tensor(step)
        x = _opmath(p)
        g = _opmath(g_in).to(x.dtype) * grad_mul
        if weight_decay != 0 and not decoupled:
            g = g + weight_decay * x

        def update(m, v):
            u = (m * c1) / (v.sqrt() * c2 + eps)
            return u + weight_decay * x if weight_decay != 0 and decoupled else u

        m = beta1 * _opmath(exp_avgs[i]) + beta3 * g
        v = beta2 * _opmath(exp_avg_sqs[i]) + (1 - beta2) * g * g
        if sums_only:
            sums.append((x, update(m, v)))
            continue
        exp_avgs[i].copy_(m)
        exp_avg_sqs[i].copy_(v)
        if trust_ratio:
            if norm_sums is None:
                pn, un = _norm(x), _norm(update(m, v))
            else:
                pn, un = (math.sqrt(s) for s in norm_sums[i].tolist())
            r = pn / un if pn > 0 and un > 0 else 1.0
            lr *= min(r, 1.0) if trust_clip else r
            if settle is not None:
                settle(exp_avgs[i])
                settle(exp_avg_sqs[i])
            m, v = _opmath(exp_avgs[i]), _opmath(exp_avg_sqs[i])
        p.copy_(x - lr * update(m, v))
    if sums_only:
        _write_sums(norm_sums, sums)


def lamb_(params, grads, exp_avgs, exp_avg_sqs, steps, *, lr, beta1, beta2, eps, weight_decay, bias_correction,
          grad_averaging, adam_w_mode, max_grad_norm, use_nvlamb, trust_clip, global_grad_norm=None, norm_sums=None,
          sums_only=False, lr_tensor=None, grad_scale=None, found_inf=None, settle=None) -> None:
    _check_norm_sums(norm_sums, sums_only, params)
    if _skip(found_inf):
        return
    lr = _lr(lr, lr_tensor)
    inv = _grad_multiplier(grad_scale, False)
    clip = 1.0
    if max_grad_norm > 0:
        norm = float(global_grad_norm.item() if global_grad_norm is not None else l2norm(grads)[0]) * inv
        clip = norm / max_grad_norm if norm > max_grad_norm else 1.0

    def per_tensor(step):
        if not bias_correction:
            return 1.0, 1.0, lr
        return 1 / (1 - beta1**step), 1 / math.sqrt(1 - beta2**step), lr

    _lamb(params, grads, exp_avgs, exp_avg_sqs, steps, per_tensor, grad_mul=inv / clip, beta1=beta1, beta2=beta2,
          beta3=1 - beta1 if grad_averaging else 1.0, eps=eps, weight_decay=weight_decay, decoupled=adam_w_mode,
          trust_ratio=use_nvlamb or weight_decay != 0, trust_clip=trust_clip, settle=settle, norm_sums=norm_sums,
          sums_only=sums_only)


def colossal_lamb_(params, grads, exp_avgs, exp_avg_sqs, steps, *, lr, beta1, beta2, eps, weight_decay, adam,
                   bias_correction, norm_sums=None, sums_only=False, lr_tensor=None, grad_scale=None, found_inf=None,
                   settle=None) -> None:
    _check_norm_sums(norm_sums, sums_only, params)
    if _skip(found_inf):
        return
    lr = _lr(lr, lr_tensor)

    def per_tensor(step):
        return 1.0, 1.0, lr * math.sqrt(1 - beta2**step) / (1 - beta1**step) if bias_correction else lr

    _lamb(params, grads, exp_avgs, exp_avg_sqs, steps, per_tensor, grad_mul=_grad_multiplier(grad_scale, False),
          beta1=beta1, beta2=beta2, beta3=1 - beta1, eps=eps, weight_decay=weight_decay, decoupled=True,
          trust_ratio=not adam, trust_clip=False, settle=settle, norm_sums=norm_sums, sums_only=sums_only)


def lion_(params, grads, exp_avgs, *, lr, beta1, beta2, weight_decay, lr_tensor=None, grad_scale=None,
          found_inf=None) -> None:
    """Lion (see csrc/shared/lion_math.h): the sign of an interpolation of m and g, decoupled decay.
    β·m is rounded, then added to (1 − β)·g as lion-pytorch adds (``add`` with ``alpha``: one fused
    multiply-add on the CPU), so that a direction within rounding of 0 takes the kernels' sign."""
    if _skip(found_inf):
        return
    lr = _lr(lr, lr_tensor)
    mul = _grad_multiplier(grad_scale, False)
    for p, g_in, exp_avg in zip(params, grads, exp_avgs):
        x = _opmath(p)
        g = _opmath(g_in).to(x.dtype) * mul
        m = _opmath(exp_avg)
        c = (m * beta1).add(g, alpha=1 - beta1)
        if weight_decay != 0:
            x = x * (1 - lr * weight_decay)
        p.copy_(x - lr * c.sign())
        exp_avg.copy_((m * beta2).add(g, alpha=1 - beta2))


def adagrad_(params, grads, sums, steps, *, lr, lr_decay, weight_decay, eps, maximize, lr_tensor=None,
             grad_scale=None, found_inf=None) -> None:
    """torch.optim.Adagrad (see csrc/shared/adagrad_math.h), per-param step counters."""
    if _skip(found_inf):
        return
    lr = _lr(lr, lr_tensor)
    mul = _grad_multiplier(grad_scale, maximize)
    for i, (p, g_in) in enumerate(zip(params, grads)):
        steps[i].add_(1)
        clr = lr / (1 + (float(steps[i].item()) - 1) * lr_decay)
        x = _opmath(p)
        g = _opmath(g_in).to(x.dtype) * mul
        if weight_decay != 0:
            g = g + weight_decay * x
        s = _opmath(sums[i]) + g * g
        sums[i].copy_(s)
        p.copy_(x - clr * g / (s.sqrt() + eps))

def l2norm(tensors) -> tuple[Tensor, Tensor]:
    """(global norm, per-tensor norms), float32 (float64 when any input is float64)."""
    dtype = torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
    device = tensors[0].device if tensors else torch.device("cpu")
    per_tensor = torch.zeros(len(tensors), dtype=torch.float64, device=device)
    for i, t in enumerate(tensors):
        per_tensor[i] = torch.linalg.vector_norm(t, dtype=torch.float64)
    return torch.linalg.vector_norm(per_tensor).to(dtype), per_tensor.to(dtype)


def sum_squares_(sums: Tensor, tensors, index) -> None:
    """sums[index[i]] += Σ tensors[i]² (float64 sums, added in tensor order)."""
    for i, t in zip(index, tensors):
        sums[i] += torch.linalg.vector_norm(t, dtype=torch.float64).square()


def grad_sum_squares_(sums: Tensor, params, index) -> None:
    """sums[index[i]] += Σ params[i].grad² for the params that have a grad."""
    with_grad = [(i, p.grad) for i, p in zip(index, params) if p.grad is not None]
    sum_squares_(sums, [g for _, g in with_grad], [i for i, _ in with_grad])
