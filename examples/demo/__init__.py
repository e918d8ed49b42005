"""``python -m examples.demo``: AdaScale scaling a real training run, against a small-batch baseline
and linear lr scaling with warm-up (the experiment is in :mod:`.plan`).

The runs train through a framework adapter (:mod:`.lightning_runs` or :mod:`.mmengine_runs`,
imported only here, when the demo runs: the optimizers never import a framework); each run
writes its result, and this module writes the table (``results.md``), all results
(``results.json``) and the plot (``demo.png``) to the output directory: by default one per
framework and mode (``demo-results/lightning``, ``demo-results/mmengine-quick``, ...), so a quick
run never replaces a full one; results already there are replaced only with ``force``.
"""

from __future__ import annotations

import importlib
import json
import time
from dataclasses import asdict
from pathlib import Path

from . import report
from .plan import QUICK, Setup, plan_runs

FRAMEWORKS = ("lightning", "mmengine")


def default_out(framework: str, quick: bool) -> Path:
    """Where a run of ``framework`` (quick or full) writes unless told otherwise."""
    return Path("demo-results") / (framework + "-quick" * quick)


def run_demo(out: str | Path | None = None, framework: str = "lightning", scales: tuple[int, ...] = (4, 8),
             seed: int = 0, quick: bool = False, lr: float | None = None, state_dtype: str | None = None,
             force: bool = False) -> Path:
    """Train every run of the plan, print the table, write the outputs to ``out`` (default:
    :func:`default_out`); returns the output dir. Refuses, before training, an ``out`` that holds
    results already, unless ``force``."""
    if framework not in FRAMEWORKS:
        raise ValueError(f"Invalid framework: {framework!r} (one of {', '.join(FRAMEWORKS)})")
    out = Path(out) if out is not None else default_out(framework, quick)
    if (out / "results.json").exists() and not force:
        raise ValueError(f"Invalid out: {out} holds the results of an earlier run; give another --out, or --force "
                         "to replace them")
    overrides = dict(QUICK if quick else {}, seed=seed, state_dtype=state_dtype)
    if lr is not None:
        overrides["lr"] = lr
    setup = Setup(**overrides)
    runs = plan_runs(setup, tuple(scales))
    train = importlib.import_module(f"{__name__}.{framework}_runs").train
    run_dir = out / "runs"
    run_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for i, run in enumerate(runs, 1):
        (run_dir / f"{run.name}.json").unlink(missing_ok=True)  # never report a stale result
        start = time.perf_counter()
        result = train(run, setup, run_dir, f"[{i}/{len(runs)}] {run.label}")
        results.append(dict(result, wall_s=time.perf_counter() - start))
    md = report.table(results, setup, framework)
    (out / "results.md").write_text(md)
    (out / "results.json").write_text(json.dumps(dict(setup=asdict(setup), framework=framework, results=results),
                                                 indent=1))
    report.plot(results, setup, out / "demo.png", framework, quick)
    print("\n" + md)
    print(f"wrote {out / 'results.md'}, {out / 'results.json'} and {out / 'demo.png'}")
    return out
