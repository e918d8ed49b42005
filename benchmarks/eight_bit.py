"""8-bit optimizer state: how precisely our blockwise code keeps a value at each distance below
its block's largest magnitude, against bitsandbytes' dynamic map, and what either costs in
training.

Precision: values x with |x| / absmax in each binade [2^-(k+1), 2^-k] (a grid of 4096 per binade,
each in blocks of 256 whose first element is the absmax 1.0), encoded and decoded; the table gives
the largest |decoded − x| / 2^-k, the error relative to the binade's top. Ours: the signed code
(first moments) and the unsigned one (second moments) of ``fused_optim.state_formats``;
bitsandbytes: ``quantize_blockwise`` / ``dequantize_blockwise`` (blocks of 256) with its signed
and unsigned dynamic maps, the ones its 8-bit Adam uses for the two moments.

Training: ``--steps`` AdamW steps (lr 3e-3, weight decay 0.01) on the digits CNN
(``examples.digits``, batches of 64) and the tiny transformer LM (``examples.tiny_lm``, batches of
16), one run per batch order (``--seeds``), with fp32 state, ours with ``state_dtype="8bit"`` and
bitsandbytes' ``AdamW8bit`` with every tensor 8-bit (``min_8bit_size=0``: ours quantizes every
tensor); the final loss over the training set (the LM: its first 256 sequences).

bitsandbytes is optional (its 8-bit optimizers run on the CPU): ``pip install bitsandbytes
torch==2.13.0``; without it its columns say "not installed".

    python -m benchmarks.eight_bit [--seeds 3] [--steps 200]
"""

from __future__ import annotations

import argparse
import importlib
import statistics

import torch
from torch.nn import functional as F

import fused_optim
from examples.digits import DigitsCNN, load_digits
from examples.tiny_lm import TinyLM, lm_loss, markov_text
from fused_optim import state_formats

BINADES = (0, 1, 2, 3, 5, 7, 10, 13, 15, 18)
GRID = 4096  # values per binade
BLOCK = state_formats.BLOCK
LR, WEIGHT_DECAY = 3e-3, 0.01
NOT_INSTALLED = "not installed"


def bitsandbytes():
    """The bitsandbytes module, or None where it is not installed."""
    try:
        return importlib.import_module("bitsandbytes")
    except ImportError:
        return None


def _binade_values(k: int) -> torch.Tensor:
    """GRID magnitudes spread over [2^-(k+1), 2^-k], alternating in sign, each block of BLOCK led by
    the absmax 1.0."""
    per_block = BLOCK - 1
    mags = torch.linspace(2.0 ** -(k + 1), 2.0 ** -k, GRID)
    signs = torch.where(torch.arange(GRID) % 2 == 0, 1.0, -1.0)
    values = (mags * signs).split(per_block)
    return torch.cat([torch.cat([torch.ones(1), v]) for v in values])


def _ours(x: torch.Tensor, signed: bool) -> torch.Tensor:
    codes, absmax = state_formats.encode_8bit(x, signed)
    return state_formats.decode_8bit(codes, absmax, signed)


def _theirs(bnb, x: torch.Tensor, signed: bool) -> torch.Tensor:
    code = bnb.functional.create_dynamic_map(signed=signed)
    codes, state = bnb.functional.quantize_blockwise(x, code=code, blocksize=BLOCK)
    return bnb.functional.dequantize_blockwise(codes, state)


def precision_rows(bnb) -> list[dict]:
    """Per binade k: the largest error / 2^-k of each code (unsigned codes on |x|)."""
    rows = []
    for k in BINADES:
        x = _binade_values(k)
        inside = x.abs() < 1.0  # not the blocks' absmax elements (exact in every code)
        row = {"binade": k}
        for signed in (True, False):
            values = x if signed else x.abs()
            name = "signed" if signed else "unsigned"
            row[f"ours {name}"] = float(((_ours(values, signed) - values).abs()[inside]).max()) * 2.0 ** k
            row[f"bitsandbytes {name}"] = (NOT_INSTALLED if bnb is None else
                                           float(((_theirs(bnb, values, signed) - values).abs()[inside]).max()) * 2.0 ** k)
        rows.append(row)
    return rows


def _train(task: str, make_opt, steps: int, seed: int) -> float:
    """The final training loss of ``steps`` steps of ``task`` ("digits" or "lm"), batch order ``seed``."""
    torch.manual_seed(0)
    if task == "digits":
        inputs, labels = load_digits("train")
        model = DigitsCNN(8)

        def loss_of(index):
            return F.cross_entropy(model(inputs[index]), labels[index])
        n, batch = len(labels), 64
    else:
        data = markov_text(1024)
        model = TinyLM()

        def loss_of(index):
            return lm_loss(model, data[index])
        n, batch = 256, 16
    opt = make_opt(list(model.parameters()))
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        loss_of(torch.randint(0, n, (batch,), generator=g)).backward()
        opt.step()
    with torch.no_grad():
        return loss_of(torch.arange(n)).item()


def variants(bnb) -> dict:
    """label -> params -> optimizer (None: not installed)."""
    kw = dict(lr=LR, weight_decay=WEIGHT_DECAY)
    return {
        "fp32 state": lambda ps: fused_optim.AdamW(ps, fused=True, **kw),
        "ours 8-bit": lambda ps: fused_optim.AdamW(ps, fused=True, state_dtype="8bit", **kw),
        "bitsandbytes AdamW8bit": None if bnb is None else (
            lambda ps: bnb.optim.AdamW8bit(ps, min_8bit_size=0, **kw)),
    }


def training_rows(bnb, steps: int, seeds: int) -> list[dict]:
    """Per task and variant: the losses of each seed, their mean, and the largest difference from
    the fp32-state run of the same seed."""
    rows = []
    for task in ("digits", "lm"):
        fp32 = None
        for label, make in variants(bnb).items():
            if make is None:
                rows.append({"task": task, "variant": label, "losses": NOT_INSTALLED})
                continue
            losses = [_train(task, make, steps, seed) for seed in range(seeds)]
            fp32 = fp32 or losses
            rows.append({"task": task, "variant": label, "losses": losses, "mean": statistics.mean(losses),
                         "max |Δ| vs fp32": max(abs(a - b) for a, b in zip(losses, fp32))})
    return rows


def markdown(precision: list[dict], training: list[dict], steps: int, seeds: int, bnb) -> str:
    version = bnb.__version__ if bnb is not None else NOT_INSTALLED
    cols = list(precision[0])
    lines = [f"bitsandbytes: {version}; torch {torch.__version__}", "",
             "Largest error / 2^-k for |x| / absmax in [2^-(k+1), 2^-k]:", "",
             "| " + " | ".join(cols) + " |", "|" + "---:|" * len(cols)]
    for row in precision:
        lines.append("| " + " | ".join(v if isinstance(v, str) else (f"{v}" if c == "binade" else f"{v:.2e}")
                                       for c, v in row.items()) + " |")
    lines += ["", f"Final training loss after {steps} AdamW steps, {seeds} batch orders:", "",
              "| task | variant | mean | max abs diff vs fp32 state (same order) | losses |", "|---|---|---:|---:|---|"]
    for row in training:
        if row["losses"] == NOT_INSTALLED:
            lines.append(f"| {row['task']} | {row['variant']} | {NOT_INSTALLED} | | |")
        else:
            lines.append(f"| {row['task']} | {row['variant']} | {row['mean']:.4f} | {row['max |Δ| vs fp32']:.4f} | "
                         + ", ".join(f"{x:.4f}" for x in row["losses"]) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.eight_bit", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seeds", type=int, default=3, help="batch orders (runs per task and variant)")
    args = parser.parse_args(argv)
    bnb = bitsandbytes()
    text = markdown(precision_rows(bnb), training_rows(bnb, args.steps, args.seeds), args.steps, args.seeds, bnb)
    print(text)
    return text


if __name__ == "__main__":
    main()
