"""The demo's outputs from the runs' results: a markdown table and a PNG plot."""

from __future__ import annotations

import math
from pathlib import Path

from fused_optim.optional import require

from .plan import Setup


def table(results: list[dict], setup: Setup, framework: str) -> str:
    """Markdown: one row per run (final validation accuracy and loss, updates and the factor
    fewer than the baseline's, τ, gain range, wall time) under a line stating the setup."""
    base_steps = next(r["steps"] for r in results if r["run"]["method"] == "baseline")
    state = "" if setup.state_dtype is None else f" ({setup.state_dtype} state)"
    lines = [f"digits 8×8 (1438 train / 359 val), CNN, FusedSGD momentum {setup.momentum}{state}, "
             f"B = {setup.batch_size}, lr = {setup.lr}, budget T = {setup.budget}, {framework}, seed {setup.seed}", "",
             "| run | val acc % | val loss | updates | fewer updates | τ | gain min–max | wall s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        gains = f"{r['gain_min']:.2f}–{r['gain_max']:.2f}" if r["gain_min"] is not None else "—"
        lines.append(f"| {r['run']['label']} | {r['val_acc']:.2f} | {r['val_loss']:.4f} | {r['steps']} | "
                     f"{base_steps / r['steps']:.1f}× | {r['tau']:.0f} | {gains} | {r['wall_s']:.1f} |")
    return "\n".join(lines) + "\n"


def figure(results: list[dict], setup: Setup, title: str):
    """Five panels: validation loss vs τ, validation loss vs optimizer updates, validation accuracy
    vs τ (every run), the gain of every AdaScale update over τ (gray lines: the scales S, the gain's
    upper bound; a Lightning epoch's short last window has a smaller one), and the gradient noise
    scale B_simple the AdaScale runs measured (gray lines: their batches B·S). Linear scaling is
    dashed, the DDP run dotted (crosses in the gain and noise panels). Every panel has a legend;
    log axes label 1-2-5 ticks in plain numbers. Returns the matplotlib figure."""
    matplotlib = require("matplotlib", "examples", "the demo's plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, (by_tau, by_step, accuracy, gain, noise) = plt.subplots(1, 5, figsize=(26, 5), constrained_layout=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, r in enumerate(results):
        run = r["run"]
        style = dict(color="black" if run["method"] == "baseline" else colors[i % len(colors)], label=run["label"],
                     linestyle=":" if run["world_size"] > 1 else "--" if run["method"] == "linear" else "-",
                     linewidth=2.2 if run["world_size"] > 1 else 1.5)
        by_tau.plot([c["tau"] for c in r["curve"]], [c["val_loss"] for c in r["curve"]], **style)
        by_step.plot([c["step"] for c in r["curve"]], [c["val_loss"] for c in r["curve"]], **style)
        accuracy.plot([c["tau"] for c in r["curve"]], [c["val_acc"] for c in r["curve"]], **style)
        if r["gains"]:
            points = dict(color=style["color"], marker="o" if run["world_size"] == 1 else "x", markersize=1.5,
                          linestyle="none", label=run["label"])
            gain.plot([g["tau"] for g in r["gains"]], [g["gain"] for g in r["gains"]], **points)
            measured = [g for g in r["gains"] if g.get("b_simple") is not None and 0 < g["b_simple"] < math.inf]
            noise.plot([g["tau"] for g in measured], [g["b_simple"] for g in measured], **points)
    for s in sorted({r["run"]["scale"] for r in results if r["gains"]}):
        gain.axhline(s, color="gray", linestyle=":", linewidth=0.8)
        noise.axhline(s * setup.batch_size, color="gray", linestyle=":", linewidth=0.8)
    for ax, x, xlabel in ((by_tau, "τ", "τ (scale-invariant steps; linear scaling: S per update)"),
                          (by_step, "updates", "optimizer updates")):
        ax.set(xlabel=xlabel, ylabel="validation loss (log)", yscale="log", title=f"validation loss vs {x}")
    accuracy.set(xlabel="τ", ylabel="validation accuracy %", title="validation accuracy vs τ", ylim=(None, 100))
    gain.set(xlabel="τ", ylabel="gain", title="AdaScale gain (gray: the scales S, its bound)", ylim=(0, None))
    noise.set(xlabel="τ", ylabel="B_simple, samples (log)", yscale="log",
              title="gradient noise scale (gray: the batches B·S)")
    for ax in (by_tau, by_step, noise):
        ax.yaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda y, _: f"{y:g}"))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    for ax in (by_tau, by_step, accuracy, gain, noise):
        ax.legend(fontsize=7)
    fig.suptitle(title)
    return fig


def plot(results: list[dict], setup: Setup, path: Path, framework: str = "lightning", quick: bool = False) -> None:
    """:func:`figure` saved as a PNG at ``path``, titled with the setup, framework and mode."""
    import matplotlib.pyplot as plt

    mode = "quick run (5× shorter budget)" if quick else "full run"
    fig = figure(results, setup, f"AdaScale vs linear scaling on digits: batch {setup.batch_size}·S, budget "
                                 f"T = {setup.budget}; {framework}, {mode}")
    fig.savefig(path, dpi=110)
    plt.close(fig)
