"""``PowerSGD``: low-rank gradient compression with error feedback (Vogels et al., 2019; mlbench_core)."""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from .. import _build
from ..torch_optim import SGD
from . import comm
from .wrapper import CommunicatingOptimizer


# The largest rank the kernels take (their per-row accumulators); a larger one runs the torch ops.
KERNEL_MAX_RANK = 4


def _kernel_runs(memories: list[Tensor], pts: list[Tensor], fused: bool | None) -> bool:
    """Whether the CPU kernel takes this call: ``fused`` True (its checks then name what does not
    fit), or None and every matrix a float32/float64 CPU one of rank ≤ KERNEL_MAX_RANK, and the
    kernels built (if not, the inner SGD has said so)."""
    if fused is None:
        fused = (bool(memories) and all(e.device.type == "cpu" and e.dtype in (torch.float32, torch.float64)
                                        for e in memories) and max(pt.shape[0] for pt in pts) <= KERNEL_MAX_RANK)
        if not fused:
            return False
        try:
            _build.load("cpu")
        except _build.BuildError:
            return False
    elif fused:
        _build.load("cpu")
    return fused


def accumulate_project_(memories: list[Tensor], grads: list[Tensor], qts: list[Tensor], pts: list[Tensor], *,
                        fused: bool | None = None) -> None:
    """Per matrix (E, G: n × m; Qᵀ: r × m; Pᵀ: r × n; all contiguous)::

        E ← E + G ;  Pᵀ = Qᵀ·Eᵀ

    ``fused_optim::powersgd_accumulate_`` does both in one pass over E and G, row by row (its
    dot products' summation order: csrc/cpu/powersgd.cpp); these torch ops are its reference,
    and run where it does not (``fused``: False the torch ops, True the kernel, None the kernel
    where it fits, :func:`_kernel_runs`)."""
    if _kernel_runs(memories, pts, fused):
        torch.ops.fused_optim.powersgd_accumulate_(memories, grads, qts, pts)
        return
    torch._foreach_add_(memories, grads)
    for e, qt, pt in zip(memories, qts, pts):
        torch.matmul(qt, e.t(), out=pt)


def decompress_(memories: list[Tensor], grads: list[Tensor], pts: list[Tensor], qts: list[Tensor], *,
                fused: bool | None = None) -> None:
    """Per matrix, as :func:`accumulate_project_` (``fused_optim::powersgd_decompress_``: one pass)::

        G ← P·Qᵀ ;  E ← E − G"""
    if _kernel_runs(memories, pts, fused):
        torch.ops.fused_optim.powersgd_decompress_(memories, grads, pts, qts)
        return
    for g, pt, qt in zip(grads, pts, qts):
        torch.matmul(pt.t(), qt, out=g)
    torch._foreach_sub_(memories, grads)


def orthogonalize_(pts: list[Tensor], eps: float = 1e-16) -> None:
    """Gram–Schmidt on the columns p₀, p₁, … of every P, given as Pᵀ (its rows), in place, all
    matrices at once (a few torch calls per column, none per matrix): for i = 0, 1, …,
    p_i ← p_i / (‖p_i‖ + eps) (a zero column stays zero), then p_j ← p_j − (p_i·p_j)·p_i for
    every j > i (the dot products summed in order, each P's a segment of one flat product)."""
    for i in range(max((pt.shape[0] for pt in pts), default=0)):
        live = [pt for pt in pts if pt.shape[0] > i]
        cols = [pt[i] for pt in live]
        norms = torch._foreach_norm(cols)
        torch._foreach_add_(norms, eps)
        torch._foreach_div_(cols, norms)
        for j in range(i + 1, max(pt.shape[0] for pt in live)):
            pairs = [(pt[i], pt[j]) for pt in live if pt.shape[0] > j]
            firsts, rests = [a for a, _ in pairs], [b for _, b in pairs]
            products = torch.cat(torch._foreach_mul(firsts, rests))
            lengths = torch.tensor([a.numel() for a in firsts], device=products.device)
            dots = torch.segment_reduce(products, "sum", lengths=lengths)
            torch._foreach_sub_(rests, torch._foreach_mul(firsts, list(dots.unbind())))


class PowerSGD(CommunicatingOptimizer):
    r"""SGD (momentum, weight decay; :class:`fused_optim.SGD`) on grads averaged by PowerSGD.

    With N ranks, r = ``rank``, per step t (after the closure), on every rank, for each param
    whose grad G is a matrix after ``view(n, -1)`` (ndim ≥ 2) with n·m > (n + m)·r·
    ``min_compression_rate`` (the *compressed* params; r is clamped to min(n, m))::

        S ← G + E                         (E: this rank's error memory, zero at first)
        M ← S.view(n, m)
        Q ← m×r, N(0, 1) from a generator seeded alike on every rank, unless reuse_query and
            a Q exists (warm start: last step's Q)
        P ← Σ_ranks M·Q ;  orthogonalize P's columns (Gram–Schmidt, eps 1e-16)
        Q ← (Σ_ranks Mᵀ·P) / N
        G ← P·Qᵀ ;  E ← S − G
    and every other param: G ← (Σ_ranks G) / N (exact, no memory). Then the SGD step (momentum
    acts on the decompressed average). P, Q and the exact grads each travel in flat buckets (P and Q
    one per dtype and device of the matrices): three kinds of collective per step (the exact
    grads' launched first and waited for last, so their transfer overlaps the compression). On CPU
    the passes over E and G are two kernels (:func:`accumulate_project_`, :func:`decompress_`).
    Before ``start_iter`` steps every grad is averaged exactly (no memory). rank ≥ min(n, m)
    reproduces the exact average (P spans the range of Σ M). With several ranks a param whose grad
    is None contributes zeros (every rank sends the same layout) and receives the average; with
    one rank nothing is communicated and the inner SGD steps as it would alone.

    The memories E, the Q of a warm start (a list of flat tensors, one per dtype and device of the
    matrices, each matrix's Qᵀ, r × m), the step count and the generator are in the state dict.

    Deviations from mlbench_core (bugs not copied): the closure runs before the aggregation; P and
    Q are kept in the grads' dtype (mlbench allocates them in the default dtype, and its eps
    tensor is float32, which rounds fp64 norms to fp32); Q comes from a private generator (mlbench
    reseeds the global RNG); a model without vectors works (mlbench's empty pack fails);
    ``by_layer=True`` is supported (one collective per tensor); ``world_size`` None means the
    group's size (master's default 1 silently skips communication). Added from torch's
    ``powerSGD_hook``: ``start_iter`` and ``min_compression_rate`` (torch's default 2; ours 0,
    mlbench's behaviour of compressing every matrix).
    """

    def __init__(self, model=None, lr: float | None = None, momentum: float = 0.0, weight_decay: float = 0.0,
                 dampening: float = 0.0, nesterov: bool = False, average_world: bool = True, use_cuda: bool = False,
                 by_layer: bool = False, reuse_query: bool = False, world_size: int | None = None, rank: int = 1, *,
                 start_iter: int = 0, min_compression_rate: float = 0.0, seed: int = 0,
                 bucket_cap_mb: float = comm.DEFAULT_BUCKET_CAP_MB):
        if not average_world:
            raise ValueError("PowerSGD averages the grads over the world: average_world must be True")
        if not (isinstance(rank, int) and rank >= 1):
            raise ValueError(f"Invalid rank: {rank} (the rank of the approximation, an int >= 1)")
        params = comm.params_of(model)
        super().__init__(SGD(params, lr=comm.given_lr(lr), momentum=momentum, dampening=dampening,
                             weight_decay=weight_decay, nesterov=nesterov))
        self.model = model
        self.params = params
        self.world_size = comm.world_size_of(world_size, "PowerSGD")
        self.rank = rank
        self.reuse_query = reuse_query
        self.by_layer = by_layer
        self.start_iter = start_iter
        self.min_compression_rate = min_compression_rate
        self.bucket_cap_mb = bucket_cap_mb
        self.generator = torch.Generator().manual_seed(seed)
        self.iteration = 0
        self._choose_compressed()
        self.q: list[Tensor | None] | None = None  # per kind, the flat Qᵀ of its matrices (warm start), once drawn
        if self.world_size > 1:
            comm.check_same_params("PowerSGD", params)

    def _choose_compressed(self) -> None:
        """Which params are compressed: a param of 2 or more dims, seen as its n × m matrix, when
        n·m > (n + m)·min(n, m, rank)·min_compression_rate (what P and Q send against the matrix);
        the others are averaged exactly. Groups the compressed ones by dtype and device."""
        params, rank = self.params, self.rank
        shapes = [(p.shape[0], p.numel() // p.shape[0]) if p.ndim > 1 and p.numel() else None for p in params]
        self.compressed = [i for i, s in enumerate(shapes)
                           if s is not None and s[0] * s[1] > (s[0] + s[1]) * min(*s, rank) * self.min_compression_rate]
        self.exact = [i for i in range(len(params)) if i not in set(self.compressed)]
        self._shapes = [shapes[i] for i in self.compressed]
        self._ranks = [min(n, m, rank) for n, m in self._shapes]
        # contiguous (a channels_last grad's memory too): each is viewed as its n × m matrix
        self.memories = [torch.zeros_like(params[i], memory_format=torch.contiguous_format) for i in self.compressed]
        # the compressed matrices by dtype and device (positions in self.compressed): each kind has
        # its own flat P and Q and their collectives (a flat buffer, and the kernels, take one dtype)
        kinds: dict[tuple, list[int]] = {}
        for k, i in enumerate(self.compressed):
            kinds.setdefault((params[i].dtype, params[i].device), []).append(k)
        self._kinds = list(kinds.values())

    def _draw_queries(self, qs: list[Tensor]) -> None:
        """Fill each Q with N(0, 1) samples from the private generator (the same on every rank)."""
        for q in qs:
            q.copy_(torch.randn(q.shape, generator=self.generator, dtype=q.dtype))

    @torch.no_grad()
    def _before_step(self) -> None:
        params = self.params
        self.iteration += 1
        if self.world_size <= 1:
            return
        for p in params:  # every rank sends the same layout: a missing grad contributes zeros
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.iteration <= self.start_iter or not self.compressed:
            comm.all_reduce_mean_([p.grad for p in params], self.world_size, by_layer=self.by_layer,
                                  cap_mb=self.bucket_cap_mb)
            return
        exact = [params[i].grad for i in self.exact]  # averaged while the matrices are compressed
        finish_exact = comm.start_mean_(exact, self.world_size, by_layer=self.by_layer, cap_mb=self.bucket_cap_mb)
        fresh = self.q is None or not self.reuse_query
        if self.q is None:
            self.q = [None] * len(self._kinds)
        decompress = [self._compress(j, kind, fresh) for j, kind in enumerate(self._kinds)]
        finish_exact()
        for finish in decompress:
            finish()

    def _compress(self, j: int, kind: list[int], fresh: bool) -> Callable[[], None]:
        """S, P and the averaged Q of the compressed matrices of kind ``j`` (positions ``kind`` in
        ``self.compressed``, one dtype and device); returns the function that then sets G ← P·Qᵀ
        and E ← S − G."""
        shapes, ranks = [self._shapes[k] for k in kind], [self._ranks[k] for k in kind]
        grads = [self.params[self.compressed[k]].grad for k in kind]
        # each grad as its contiguous n × m matrix (a channels_last one's copy, written back at the end)
        dense = [(g if g.is_contiguous() else g.contiguous()).view(n, m) for g, (n, m) in zip(grads, shapes)]
        matrices = [self.memories[k].view(n, m) for k, (n, m) in zip(kind, shapes)]
        dtype, device = grads[0].dtype, grads[0].device
        # P and Q are stored transposed (r × n, r × m per matrix, in the flat buckets): the products
        # are then Qᵀ·Mᵀ and Pᵀ·M, matrix products with a short contiguous left factor, which BLAS
        # runs at memory speed; M·Q with r ≥ 2 columns is several times slower on CPU.
        p_flat = torch.empty(sum(n * r for (n, _), r in zip(shapes, ranks)), dtype=dtype, device=device)
        pts = comm.views(p_flat, [(r, n) for (n, _), r in zip(shapes, ranks)])
        if self.q[j] is None:
            self.q[j] = torch.empty(sum(m * r for (_, m), r in zip(shapes, ranks)), dtype=dtype, device=device)
        q = self.q[j]
        qts = comm.views(q, [(r, m) for (_, m), r in zip(shapes, ranks)])
        if fresh:
            self._draw_queries([qt.t() for qt in qts])
        accumulate_project_(matrices, dense, qts, pts)  # E ← S = G + E (E now holds S);  Pᵀ = Qᵀ·Sᵀ
        self._all_reduce(p_flat, pts)
        orthogonalize_(pts)
        for mat, qt, pt in zip(matrices, qts, pts):
            torch.matmul(pt, mat, out=qt)  # Qᵀ = Pᵀ·M
        self._all_reduce(q, qts)
        q.div_(self.world_size)

        def finish() -> None:
            # G ← P·Qᵀ (straight into the grad: a fresh n × m buffer costs its page faults each step);
            # E ← S − G
            decompress_(matrices, dense, pts, qts)
            for g, d in zip(grads, dense):
                if d.data_ptr() != g.data_ptr():
                    g.copy_(d.view(g.shape))

        return finish

    def _all_reduce(self, flat: Tensor, parts: list[Tensor]) -> None:
        """Σ_ranks of a flat buffer: whole, or part by part with ``by_layer`` (all in flight at once)."""
        for work in [comm.all_reduce_async(part) for part in (parts if self.by_layer else [flat])]:
            work.wait()

    def _comm_state(self) -> dict:
        return {"memories": [m.clone() for m in self.memories], "iteration": self.iteration,
                "generator": self.generator.get_state(),
                **({} if self.q is None else {"q_t": [q.clone() for q in self.q]})}

    def _load_comm_state(self, state: dict) -> None:
        torch._foreach_copy_(self.memories, list(state["memories"]))
        self.iteration = int(state["iteration"])
        self.generator.set_state(state["generator"])
        q = state.get("q_t")
        # one flat tensor: saved before Q was kept per kind (one dtype and device: a single kind)
        self.q = None if q is None else [q.clone()] if isinstance(q, Tensor) else [t.clone() for t in q]
        if "q" in state:  # an earlier layout: each matrix's Q (m × r), not Qᵀ
            self.q = [torch.cat([q.t().reshape(-1) for q in comm.views(
                state["q"], [(m, r) for (_, m), r in zip(self._shapes, self._ranks)])])]
