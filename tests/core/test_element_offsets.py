"""Stochastic rounding of shards: the compact ops' ``element_offsets``; and SparsifiedSGD's shards.

Stochastic rounding draws each element's 16 random bits by (the param's rounding key, the list's
stream, the element's index). A param that is a contiguous part of a bigger tensor (a ``Shard(0)``
DTensor's local tensor, fused_optim/sharding.py) passes the index of its first element in the
whole tensor, so its elements draw the bits they have in the whole tensor: updating the pieces
one by one, each with its offset, is updating the whole tensor, bit for bit (the elementwise ops;
the layer-wise ones also need the whole tensors' norms, tests/distributed). Checked on the CPU
kernels, the CUDA kernels (emulated; on a GPU under make check-gpu's ``-m cuda``) and the
reference, for bf16 state rounded stochastically and for bf16 params rounded stochastically.
"""

import pytest
import torch

from fused_optim import _build
from fused_optim.specs import SPECS
from test_state_dtype import _args, _clone
from test_unscaled_grads import IMPLEMENTATIONS, run_op

ELEMENTWISE = ["adam_", "sgd_", "sign_sgd_", "lion_", "adagrad_"]
N = 70_300  # one tensor; its pieces start at offsets no multiple of a SIMD block, an 8-bit block or a CUDA chunk
CUTS = (0, 1, 300, 70_001)


def _whole(op: str, param_dtype, seed: int = 0) -> tuple:
    """test_state_dtype's inputs (params, grads, moment lists, step lists, absmaxes, keys) for
    one tensor of N elements, bf16 moments (adam_ without amsgrad)."""
    g = torch.Generator().manual_seed(seed)
    lists = []
    for _, lst in SPECS[op].compact_lists():
        if lst.when == "amsgrad":
            lists.append([])
            continue
        values = torch.randn(N, generator=g) if lst.sample != "nonnegative" else torch.rand(N, generator=g) ** 4
        lists.append([values.to(torch.bfloat16)])
    steps = [[torch.tensor(3.0)]] if any(s.sample == "counter" for s in SPECS[op].state) else []
    return ([torch.randn(N, generator=g).to(param_dtype)], [torch.randn(N, generator=g).to(param_dtype)], lists,
            steps, [], [torch.tensor(12345678901)])


def _pieces(whole: tuple) -> tuple:
    """The same call over the pieces [CUTS[i], CUTS[i + 1]) of the tensor: views of its params
    and moments (updated in place), a step counter and a rounding key of their own each."""
    params, grads, lists, steps, _, keys = whole
    bounds = [*CUTS, N]
    cut = lambda x: [x[a:b] for a, b in zip(bounds, bounds[1:])]  # noqa: E731
    k = len(CUTS)
    return (cut(params[0]), cut(grads[0]), [cut(lst[0]) if lst else [] for lst in lists],
            [[s[0].clone() for _ in range(k)] for s in steps], [], [keys[0].clone() for _ in range(k)])


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("sr_state,sr_params", [(True, False), (False, True), (True, True)],
                         ids=["srstate", "srparams", "both"])
@pytest.mark.parametrize("op", ELEMENTWISE)
def test_pieces_with_their_offsets_round_as_the_whole_tensor(op, sr_state, sr_params, implementation):
    flags = dict(stochastic_state=sr_state, stochastic_params=sr_params)
    whole = _whole(op, torch.bfloat16 if sr_params else torch.float32)
    pieced = _clone(list(whole))
    args, scalars = _args(op, whole)
    run_op(SPECS[op].compact_name, implementation, args, {**scalars, **flags})
    pieces = _pieces(pieced)
    args, scalars = _args(op, pieces)
    run_op(SPECS[op].compact_name, implementation, args, {**scalars, **flags, "element_offsets": list(CUTS)})
    assert torch.equal(pieced[0][0], whole[0][0])  # the params: every piece a view of them
    for lst, lst_whole in zip(pieced[2], whole[2]):
        assert all(torch.equal(a, b) for a, b in zip(lst, lst_whole))  # the moments
    assert all(int(k) == int(whole[5][0]) for k in pieces[5])  # each piece's key advanced once


def test_without_offsets_a_piece_draws_other_bits():
    """The premise: the offsets matter (a piece stepped as a tensor of its own rounds by its
    local indices, other bits than its elements' in the whole tensor)."""
    results = []
    for offsets in ([0], [5]):
        x = _whole("sgd_", torch.bfloat16)
        args, scalars = _args("sgd_", x)
        run_op("sgd_compact_", "cpu", args, {**scalars, "stochastic_params": True, "element_offsets": offsets})
        results.append(x[0][0])
    assert not torch.equal(*results)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_element_offsets_of_another_length_are_refused(implementation):
    args, scalars = _args("adam_", _whole("adam_", torch.float32))
    with pytest.raises((RuntimeError, ValueError), match="element_offsets has 2 entries for 1 params"):
        run_op("adam_compact_", implementation, args, {**scalars, "stochastic_state": True, "element_offsets": [0, 9]})


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("random_sparse", [True, False], ids=["random", "block"])
def test_sparsified_shards_apply_the_whole_tensors_coordinates(implementation, random_sparse):
    """SparsifiedSGD draws k coordinates per whole tensor. Two tensors cut into the boxes four
    "ranks" hold (a vector in ranges, as Shard(0) cuts it; a matrix in a 2 × 2 grid, as
    [Shard(0), Shard(1)] does), each rank a call of its own with the generator in the same state,
    as every rank's optimizer has it: with ``whole_shapes`` and ``box_offsets`` each box applies
    the coordinates of its whole tensor inside it, so together they update as the whole tensors
    did, bit for bit (k = 3000 of 9000 and of 70 300: random coordinates land in every box)."""
    shapes = ((N,), (90, 100))
    boxes = {0: ((0,), (0, 0)), 1: ((300,), (0, 37)), 2: ((35_001,), (41, 0)), 3: ((50_003,), (41, 37))}
    ends = {0: ((300,), (41, 37)), 1: ((35_001,), (41, 100)), 2: ((50_003,), (90, 37)), 3: ((N,), (90, 100))}
    g = torch.Generator().manual_seed(5)
    whole = [[torch.randn(shape, generator=g) for shape in shapes] for _ in range(3)]  # params, grads, memories
    pieced = [[t.clone() for t in lst] for lst in whole]
    kwargs = dict(lr=0.1, weight_decay=0.01, sparse_grad_size=3000, random_sparse=random_sparse,
                  generator=torch.Generator().manual_seed(7))
    run_op("sparsified_sgd_", implementation, [*whole, []], kwargs)  # (no master weights)
    for rank in range(4):
        cut = [tuple(slice(a, b) for a, b in zip(start, end)) for start, end in zip(boxes[rank], ends[rank])]
        views = [[t[c].contiguous() for t, c in zip(lst, cut)] for lst in pieced]
        run_op("sparsified_sgd_", implementation, [*views, []],
               {**kwargs, "whole_shapes": [n for shape in shapes for n in shape],
                "box_offsets": [o for start in boxes[rank] for o in start]})
        for lst, box in zip(pieced, views):
            for t, c, v in zip(lst, cut, box):
                t[c] = v
    for what, got, expected in zip(("param", "grad", "memory"), pieced, whole):
        assert all(torch.equal(a, b) for a, b in zip(got, expected)), what
    for memory in pieced[2]:  # coordinates were applied in every box (random), in some box (a block)
        hit = [bool((memory[tuple(slice(a, b) for a, b in zip(boxes[r][memory.dim() - 1], ends[r][memory.dim() - 1]))]
                     == 0).any()) for r in range(4)]
        assert all(hit) if random_sparse else any(hit), hit


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_sparsified_shard_outside_its_whole_tensor_is_refused_before_any_write(implementation):
    """On a GPU the tensors are made there and the op called directly: run_op copies results back
    only when the op returns."""
    device = "cuda" if implementation == "gpu" else "cpu"
    args = [[torch.ones(10, device=device), torch.ones(4, 5, device=device)] for _ in range(3)] + [[]]
    kwargs = dict(lr=0.1, weight_decay=0.1, sparse_grad_size=3, random_sparse=True, whole_shapes=[10, 4, 7],
                  box_offsets=[0, 0, 3])
    with pytest.raises((RuntimeError, ValueError), match=r"param 1 \(\[4, 5\]\) at box_offsets \[0, 3\] does not "
                                                         r"lie in its whole tensor \[4, 7\]"):
        if implementation == "gpu":
            _build.load("cuda")
            torch.ops.fused_optim.sparsified_sgd_(*args, **kwargs)
        else:
            run_op("sparsified_sgd_", implementation, args, kwargs)
    assert all(bool((t == 1).all()) for lst in args[:3] for t in lst)


@pytest.mark.parametrize("implementation", ["cpu", "emulated_cuda", "reference"])
def test_a_skipped_sparsified_step_draws_no_coordinates(implementation):
    """An AMP step skipped for an overflow (found_inf) changes nothing, the generator included: the
    next step draws what it would have drawn without the skipped one, on every implementation
    (the CUDA binding reads found_inf before its host draw). The generator itself is passed here
    (run_op would pass a fresh copy)."""
    generator = torch.Generator().manual_seed(11)
    before = generator.get_state()
    args = [[torch.ones(100)] for _ in range(3)] + [[]]
    kwargs = dict(lr=0.1, weight_decay=0.0, sparse_grad_size=3, random_sparse=True, generator=generator,
                  grad_scale=torch.tensor(1024.0), found_inf=torch.tensor(1.0))
    if implementation == "reference":
        SPECS["sparsified_sgd_"].run_reference(*args, **kwargs)
    elif implementation == "cpu":
        _build.load("cpu")
        torch.ops.fused_optim.sparsified_sgd_(*args, **kwargs)
    else:
        _build.load_emulated_cuda()
        torch.ops.fused_optim_emulated_cuda.sparsified_sgd_(*args, **kwargs)
    assert torch.equal(generator.get_state(), before)
    assert all(bool((t == 1).all()) for lst in args[:3] for t in lst)
