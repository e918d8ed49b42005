"""Subprocess side of tests/test_adascale_ddp.py (run as a script; also imported by the test for
the model, the data and the loops, so that both sides train the same way).

    adascale_worker.py ddp RANK PORT OUT   one of 2 gloo ranks: DDP, accumulation 2, ours then fairscale
    adascale_worker.py save CKPT           4 steps and one backward of step 4, then save and exit
    adascale_worker.py resume CKPT OUT     load, finish step 4, go on to step 8
    adascale_worker.py straight OUT        steps 0..8 without interruption
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from adascale_loops import micro_batch, model_and_groups  # noqa: E402

STEPS = 12


def backward(model, step: int, micro: int, accum: int) -> None:
    x, y = micro_batch(step, micro)
    (torch.nn.functional.mse_loss(model(x), y) / accum).backward()


def record(opt, model, trace: list) -> None:
    trace.append({"gain": float(opt.gain()),
                  "gains": [float(opt.gain(k)) for k in range(len(opt.param_groups))],
                  "tau": float(getattr(opt, "scale_invariant_steps", float("nan"))),
                  "params": [p.detach().clone() for p in model.parameters()]})


def train(wrap, two_groups: bool, micros, accum: int, ddp: bool = False) -> list:
    """SGD(lr=0.1, momentum=0.9) wrapped by ``wrap``; each step runs the micro-batches
    ``micros`` (of that step) with losses divided by ``accum``. Under ``ddp`` all but the last
    backward of the window run inside ``no_sync()``."""
    model, groups = model_and_groups(two_groups)
    net = torch.nn.parallel.DistributedDataParallel(model) if ddp else model
    opt = wrap(torch.optim.SGD(groups, lr=0.1, momentum=0.9))
    trace = []
    for step in range(STEPS):
        for i, m in enumerate(micros):
            if ddp and i < len(micros) - 1:
                with net.no_sync():
                    backward(net, step, m, accum)
            else:
                backward(net, step, m, accum)
        opt.step()
        opt.zero_grad()
        record(opt, model, trace)
    return trace


def ddp_main(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from fairscale.optim.adascale import AdaScale as FairscaleAdaScale

    import fused_optim

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=1200))
    try:
        assert dist.get_world_size() == 2 and dist.get_rank() == rank
        micros = (2 * rank, 2 * rank + 1)
        results = {}
        for two_groups in (False, True):
            def ours(inner):
                opt = fused_optim.AdaScale(inner, num_gradients_to_accumulate=2)
                assert opt.scale == 4.0  # world size 2 from the process group, times 2
                return opt

            def theirs(inner):
                opt = FairscaleAdaScale(inner, num_gradients_to_accumulate=2)
                assert opt.scale == 4.0
                return opt

            results[two_groups] = {"ours": train(ours, two_groups, micros, 2, ddp=True),
                                   "fairscale": train(theirs, two_groups, micros, 2, ddp=True)}
        torch.save({"world_size": dist.get_world_size(), "rank": rank, "results": results}, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


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
