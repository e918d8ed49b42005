"""The small model, micro-batches and loops the AdaScale tests share."""

import torch


def model_and_groups(two_groups: bool):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    params = list(model.parameters())
    groups = [{"params": params[:2]}, {"params": params[2:], "lr": 0.05}] if two_groups else [{"params": params}]
    return model, groups


def micro_batch(step: int, micro: int):
    gen = torch.Generator().manual_seed(1000 * step + micro)
    x = torch.randn(4, 8, generator=gen)
    return x, torch.sin(x[:, :4] * 3) + 0.3 * torch.randn(4, 4, generator=gen)


def backward_window(model, step: int, accum: int, passes: int | None = None) -> None:
    """The window's backward passes (``passes``, default ``accum``) of losses divided by accum, on
    the model's device."""
    device = next(model.parameters()).device
    for m in range(accum if passes is None else passes):
        x, y = (t.to(device) for t in micro_batch(step, m))
        (torch.nn.functional.mse_loss(model(x), y) / accum).backward()


def step_windows(model, opt, steps) -> None:
    """For each step of ``steps``: its full window of 2 micro-batches, then ``opt.step()`` and
    ``opt.zero_grad()``."""
    for step in steps:
        backward_window(model, step, 2)
        opt.step()
        opt.zero_grad()
