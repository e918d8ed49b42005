"""The norm kernels: multi_tensor_l2norm equals torch.linalg.vector_norm per tensor and globally,
sum_squares_ adds per-group sums of squares; both independent of the thread count, on every dtype
and odd shape."""

import pytest
import torch

import fused_optim


def tensors(dtype=None):
    gen = torch.Generator().manual_seed(0)
    shapes = [(1,), (4097,), (33, 65), (0,), (100_003,), (3, 1, 7)]
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float32, torch.float32, torch.float16]
    return [(torch.randn(s, generator=gen) * 3).to(dtype or d) for s, d in zip(shapes, dtypes)]


def exact(ts):
    per = torch.stack([torch.linalg.vector_norm(t.double()) for t in ts])
    return torch.linalg.vector_norm(per), per


@pytest.mark.parametrize("fused", [True, False], ids=["kernel", "reference"])
@pytest.mark.parametrize("dtype", [None, torch.float32, torch.float64, torch.bfloat16, torch.float16],
                         ids=["mixed", "fp32", "fp64", "bf16", "fp16"])
def test_equals_vector_norm_per_tensor_and_globally(dtype, fused):
    ts = tensors(dtype)
    total, per = fused_optim.multi_tensor_l2norm(ts, per_tensor=True, fused=fused)
    want_total, want_per = exact(ts)
    out_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    assert total.dtype == per.dtype == out_dtype and total.shape == () and per.shape == (len(ts),)
    rtol = 1e-12 if dtype == torch.float64 else 2e-6
    torch.testing.assert_close(per.double(), want_per, rtol=rtol, atol=0.0)
    torch.testing.assert_close(total.double(), want_total, rtol=rtol, atol=0.0)
    # against torch's own fp32 reductions too (what users compare with)
    torch.testing.assert_close(per, torch.stack([torch.linalg.vector_norm(t.to(out_dtype)) for t in ts]),
                               rtol=1e-5, atol=0.0)
    assert torch.equal(fused_optim.multi_tensor_l2norm(ts, fused=fused), total)


def test_same_bits_with_one_and_two_threads():
    ts = [t.float() for t in tensors()] + [torch.randn(1_000_000)]
    results = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        results.append(fused_optim.multi_tensor_l2norm(ts, per_tensor=True, fused=True))
    torch.set_num_threads(2)
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_non_contiguous_and_empty_inputs():
    x = torch.randn(64, 65)[:, ::2]
    total, per = fused_optim.multi_tensor_l2norm([x], per_tensor=True, fused=True)
    torch.testing.assert_close(per[0], torch.linalg.vector_norm(x), rtol=1e-6, atol=0.0)
    total, per = fused_optim.multi_tensor_l2norm([], per_tensor=True, fused=True)
    assert total.item() == 0.0 and per.shape == (0,)


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(RuntimeError, match=r"tensors\[1\] is sparse"):
        fused_optim.multi_tensor_l2norm([torch.ones(2), torch.ones(2).to_sparse()], fused=True)
    with pytest.raises(RuntimeError, match=r"tensors\[0\] has dtype Long"):
        fused_optim.multi_tensor_l2norm([torch.ones(2, dtype=torch.long)], fused=True)


def test_opcheck():
    torch.library.opcheck(torch.ops.fused_optim.l2norm.default, ([torch.randn(5), torch.randn(4097).bfloat16()],))


@pytest.mark.parametrize("fused", [True, False], ids=["kernel", "reference"])
def test_sum_squares_adds_per_group_sums(fused):
    ts = tensors()
    index = [2, 0, 2, 1, 0, 2]
    sums = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    fused_optim.sum_squares_(sums, ts, index, fused=fused)
    squares = exact(ts)[1].square()
    want = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64).index_add_(0, torch.tensor(index), squares)
    torch.testing.assert_close(sums, want, rtol=2e-6, atol=0.0)


def test_sum_squares_same_bits_with_one_and_two_threads():
    ts = [t.float() for t in tensors()] + [torch.randn(1_000_000)]
    results = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        sums = torch.zeros(2, dtype=torch.float64)
        fused_optim.sum_squares_(sums, ts, [i % 2 for i in range(len(ts))], fused=True)
        results.append(sums)
    torch.set_num_threads(2)
    assert torch.equal(results[0], results[1])


def test_sum_squares_bad_inputs_raise_clear_errors_and_change_nothing():
    sums = torch.zeros(2, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="index has 1 entries for 2 tensors"):
        fused_optim.sum_squares_(sums, [torch.ones(2), torch.ones(3)], [0], fused=True)
    with pytest.raises(RuntimeError, match=r"index\[1\] = 2 is out of range for sums of size 2"):
        fused_optim.sum_squares_(sums, [torch.ones(2), torch.ones(3)], [0, 2], fused=True)
    with pytest.raises(RuntimeError, match="sums must be a contiguous 1-D float64 CPU tensor"):
        fused_optim.sum_squares_(torch.zeros(2), [torch.ones(2)], [0], fused=True)
    with pytest.raises(RuntimeError, match=r"tensors\[0\] has dtype Long"):
        fused_optim.sum_squares_(sums, [torch.ones(2, dtype=torch.long)], [0], fused=True)
    assert torch.equal(sums, torch.zeros(2, dtype=torch.float64))


def test_sum_squares_opcheck():
    sums = torch.zeros(3, dtype=torch.float64)
    torch.library.opcheck(torch.ops.fused_optim.sum_squares_.default,
                          (sums, [torch.randn(5), torch.randn(4097).bfloat16()], [2, 0]))


@pytest.mark.parametrize("fused", [True, False], ids=["kernel", "reference"])
def test_grad_sum_squares_adds_the_grads_of_the_params_that_have_one(fused):
    params = [torch.zeros_like(t).requires_grad_() for t in tensors()]
    for p, t in zip(params, tensors()):
        p.grad = t
    params[3].grad = None
    index = [2, 0, 2, 1, 0, 2]
    sums = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    fused_optim.norm.grad_sum_squares_(sums, params, index, fused=fused)
    want = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    fused_optim.sum_squares_(want, [t for i, t in enumerate(tensors()) if i != 3], [2, 0, 2, 0, 2], fused=fused)
    assert torch.equal(sums, want)
