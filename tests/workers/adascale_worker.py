"""Subprocess side of tests/distributed/test_adascale_ddp.py (run as a script; also imported by the test for
the model, the data and the loops, so that both sides train the same way).

    adascale_worker.py ddp RANK PORT OUT   one of 2 gloo ranks: DDP, accumulation 2, ours and fairscale
    adascale_worker.py save CKPT           4 steps and one backward of step 4, then save and exit
    adascale_worker.py resume CKPT OUT     load, finish step 4, go on to step 8
    adascale_worker.py straight OUT        steps 0..8 without interruption
"""

from __future__ import annotations

import copy
import os
import sys
from datetime import timedelta

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: adascale_loops
from adascale_loops import micro_batch, model_and_groups  # noqa: E402

STEPS = 12


def backward(model, step: int, micro: int, accum: int) -> None:
    x, y = micro_batch(step, micro)
    (torch.nn.functional.mse_loss(model(x), y) / accum).backward()


def window(net, step: int, micros, accum: int, ddp: bool) -> None:
    """The step's micro-batches ``micros``, losses divided by ``accum``; under ``ddp`` all but the
    last backward run inside ``no_sync()``."""
    for i, m in enumerate(micros):
        if ddp and i < len(micros) - 1:
            with net.no_sync():
                backward(net, step, m, accum)
        else:
            backward(net, step, m, accum)


def observe(opt, model) -> dict:
    """What fairscale's documented loop sees between the window's last backward and step()."""
    return {"gain": float(opt.gain()), "gains": [float(opt.gain(k)) for k in range(len(opt.param_groups))]}


def after_step(opt, model) -> dict:
    return {"after_gain": float(opt.gain()), "tau": float(getattr(opt, "scale_invariant_steps", float("nan"))),
            "params": [p.detach().clone() for p in model.parameters()]}


def train_lockstep(two_groups: bool, micros, accum: int) -> dict:
    """Ours and fairscale's AdaScale over SGD(lr=0.1, momentum=0.9) in float64, each on its own DDP
    model, step by step: each step records what fairscale's documented loop reads
    (``backward; tau += opt.gain(); opt.step()``) and the params after it; then fairscale's params
    and momentum buffers are set to ours, so every step of the two starts from the same state
    (see tests/core/test_adascale.py for why). Ours also records its model and optimizer state before
    each step, for the one-process replay."""
    import torch.distributed as dist
    from fairscale.optim.adascale import AdaScale as FairscaleAdaScale

    import fused_optim

    trace = {"ours": [], "fairscale": []}
    runs = []
    for name, cls in (("ours", fused_optim.AdaScale), ("fairscale", FairscaleAdaScale)):
        model, groups = model_and_groups(two_groups)
        opt = cls(torch.optim.SGD(groups, lr=0.1, momentum=0.9), num_gradients_to_accumulate=accum)
        assert opt.scale == dist.get_world_size() * accum  # the world size from the process group
        runs.append((name, model, torch.nn.parallel.DistributedDataParallel(model), opt))
    (_, model, _, ours), (_, ref_model, _, theirs) = runs
    for step in range(STEPS):
        before = copy.deepcopy({"model": model.state_dict(), "opt": ours.state_dict()})  # (live tensors)
        for name, m, net, opt in runs:
            window(net, step, micros, accum, ddp=True)
            record = observe(opt, m)
            opt.step()
            record.update(after_step(opt, m))
            trace[name].append(record)
        trace["ours"][-1]["before"] = before
        for p, q in zip(model.parameters(), ref_model.parameters()):
            q.data.copy_(p.data)
            theirs.state[q]["momentum_buffer"].copy_(ours.state[p]["momentum_buffer"])
        for _, _, _, opt in runs:
            opt.zero_grad()
    return trace


def ddp_main(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from fused_optim.process_group import end_process_group, init_process_group

    init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                       timeout=timedelta(seconds=1200))
    assert dist.get_world_size() == 2 and dist.get_rank() == rank
    torch.set_default_dtype(torch.float64)  # fairscale's micro-batch sums take the default dtype
    micros = (2 * rank, 2 * rank + 1)
    results = {two_groups: train_lockstep(two_groups, micros, 2) for two_groups in (False, True)}
    torch.save({"world_size": dist.get_world_size(), "rank": rank, "results": results}, out)
    end_process_group()  # its gloo threads end before this process's Python does


# ---- save mid-window / resume in a fresh process ---------------------------------------------------
def fused_start():
    import fused_optim

    model, groups = model_and_groups(two_groups=True)
    opt = fused_optim.AdaScale(fused_optim.FusedSGD(groups, lr=0.1, momentum=0.9), world_size=1,
                               num_gradients_to_accumulate=2)
    return model, opt


def fused_steps(model, opt, steps) -> None:
    for step in steps:
        backward(model, step, 0, 2)
        backward(model, step, 1, 2)
        opt.step()
        opt.zero_grad()


def final(model, opt, out: str) -> None:
    torch.save({"params": [p.detach().clone() for p in model.parameters()], "gain": opt.gain(),
                "gains": [opt.gain(k) for k in range(len(opt.param_groups))],
                "tau": opt.scale_invariant_steps}, out)


def save_main(ckpt: str) -> None:
    model, opt = fused_start()
    fused_steps(model, opt, range(4))
    backward(model, 4, 0, 2)  # mid-window
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                "grads": [p.grad for p in model.parameters()]}, ckpt)


def resume_main(ckpt: str, out: str) -> None:
    model, opt = fused_start()
    state = torch.load(ckpt, weights_only=True)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    for p, g in zip(model.parameters(), state["grads"]):
        p.grad = g
    backward(model, 4, 1, 2)  # the window's second backward
    opt.step()
    opt.zero_grad()
    fused_steps(model, opt, range(5, 9))
    final(model, opt, out)


def straight_main(out: str) -> None:
    model, opt = fused_start()
    fused_steps(model, opt, range(9))
    final(model, opt, out)


if __name__ == "__main__":
    torch.set_num_threads(1)  # two processes at a time on the test machine's 2 cores
    from fused_optim import _build

    _build.load()  # a kernel build failure fails here, loudly, not as a silent fallback
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "ddp":
        ddp_main(int(args[0]), int(args[1]), args[2])
    elif mode == "save":
        save_main(args[0])
    elif mode == "resume":
        resume_main(args[0], args[1])
    elif mode == "straight":
        straight_main(args[0])
    else:
        raise SystemExit(f"unknown mode {mode!r}")
