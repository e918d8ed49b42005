"""PowerSGD's CPU kernels (fused_optim::powersgd_accumulate_ / powersgd_decompress_) against their
torch-op reference (fused_optim.distributed.powersgd), and the all-matrices Gram–Schmidt against
a QR decomposition. The end-to-end trajectories (mlbench's goldens) are tests/distributed/test_distributed.py's."""

from __future__ import annotations

import pytest
import torch

from fused_optim.distributed.powersgd import KERNEL_MAX_RANK, accumulate_project_, decompress_, orthogonalize_

# n × m: rows shorter than one SIMD block, tails of every length mod 16 / mod 8, one row, one column
SHAPES = [(5, 37), (64, 147), (3, 16), (17, 1), (1, 300), (40, 9)]


def problem(dtype, rank, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ranks = [min(n, m, rank) for n, m in SHAPES]

    def rand(*shape):
        return torch.randn(shape, generator=gen, dtype=dtype)

    return ([rand(n, m) for n, m in SHAPES], [rand(n, m) for n, m in SHAPES],
            [rand(r, m) for (_, m), r in zip(SHAPES, ranks)], [rand(r, n) for (n, _), r in zip(SHAPES, ranks)])


def run(fused, memories, grads, qts, pts, threads=1):
    """Both passes (as a step runs them); returns (E after the first, Pᵀ, G, E after the second)."""
    memories, grads, pts = [[t.clone() for t in ts] for ts in (memories, grads, pts)]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        accumulate_project_(memories, grads, qts, pts, fused=fused)
        accumulated = [e.clone() for e in memories]
        decompress_(memories, grads, pts, qts, fused=fused)
    finally:
        torch.set_num_threads(before)
    return accumulated, pts, grads, memories


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rank", range(1, KERNEL_MAX_RANK + 1))
def test_kernels_equal_the_torch_ops(dtype, rank):
    """E + G is one rounding in both: equal. A dot product of length k, in any order, with or
    without FMA, is within γ_k·Σ|aᵢbᵢ| (γ_k = k·u/(1 − k·u), u = eps/2) of the exact one, so the
    kernel's and torch's are within 2γ_k·Σ|aᵢbᵢ| ≈ k·eps·Σ|aᵢbᵢ| of each other: k = m for Pᵀ, r for
    G = P·Qᵀ (r = 1: one product, equal). E − G is then one rounding of the kernel's own G: equal
    to torch's subtraction of it. A wrong index or a missed tail element is off by O(1)."""
    memories, grads, qts, pts = problem(dtype, rank)
    eps = torch.finfo(dtype).eps
    acc_k, pts_k, g_k, e_k = run(True, memories, grads, qts, pts)
    acc_ref, pts_ref, _, _ = run(False, memories, grads, qts, pts)
    for i, (n, m) in enumerate(SHAPES):
        assert torch.equal(acc_k[i], acc_ref[i])
        bound = m * eps * (qts[i].abs() @ acc_k[i].abs().t())
        assert ((pts_k[i] - pts_ref[i]).abs() <= bound).all(), f"Pᵀ of matrix {i}"
        p = pts_k[i]
        g_ref = p.t() @ qts[i]  # torch's product of the same factors
        r = p.shape[0]
        assert ((g_k[i] - g_ref).abs() <= r * eps * (p.t().abs() @ qts[i].abs())).all(), f"G of matrix {i}"
        if r == 1:
            assert torch.equal(g_k[i], g_ref)
        assert torch.equal(e_k[i], acc_k[i] - g_k[i])


def test_kernels_do_not_depend_on_the_thread_count():
    """A row is one thread's, summed in a fixed order: 1 and 2 threads give the same bits."""
    args = problem(torch.float32, 3, seed=1)
    for a, b in zip(run(True, *args, threads=1), run(True, *args, threads=2)):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_kernel_refuses_what_it_cannot_take():
    memories, grads, qts, pts = problem(torch.float64, 2)
    with pytest.raises(RuntimeError, match=r"grads\[1\] must be a contiguous Double CPU tensor of shape \[64, 147\]"):
        accumulate_project_(memories, [grads[0], grads[1].t().contiguous().t()] + grads[2:], qts, pts, fused=True)
    wide = [torch.zeros(KERNEL_MAX_RANK + 1, n, dtype=torch.float64) for n, _ in SHAPES]
    with pytest.raises(RuntimeError, match=rf"pts\[0\] must be r × 5 with 1 ≤ r ≤ {KERNEL_MAX_RANK}"):
        decompress_(memories, grads, wide, qts, fused=True)


def test_orthogonalize_is_qr_of_every_matrix_at_once():
    """Gram–Schmidt (modified: each column normalized, then projected out of the later ones) of a
    full-rank P gives QR's Q with R's diagonal made positive. float64, n ≤ 64, condition numbers of
    random Gaussian matrices ~10: the two differ by ~n·u·cond ≈ 1e-13 at most; a wrong segment
    (one matrix's dot product summed into another's) is off by O(1). A zero column stays zero."""
    gen = torch.Generator().manual_seed(2)
    pts = [torch.randn(r, n, generator=gen, dtype=torch.float64) for r, n in [(1, 5), (4, 64), (3, 7), (2, 2)]]
    expected = []
    for pt in pts:
        q, r = torch.linalg.qr(pt.t())
        expected.append((q * r.diagonal().sign()).t())
    zero = torch.zeros(2, 6, dtype=torch.float64)
    orthogonalize_(pts + [zero])
    for got, want in zip(pts, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-13)
    assert torch.equal(zero, torch.zeros_like(zero))
