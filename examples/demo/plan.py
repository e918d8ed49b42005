"""The demo's experiment: one baseline, AdaScale and linear lr scaling at each scale S, all on the
same budget of T scale-invariant steps (τ).

* baseline: batch B, lr η, cosine schedule over T updates (τ = updates).
* AdaScale at S: S micro-batches of B per update (``ranks × accumulation``); the cosine schedule
  runs on ⌊τ⌋ and training stops once τ = Σ gain reaches T.
* linear scaling at S (Goyal et al., 2017): batch S·B, lr S·η after a linear warm-up from η over
  the first ``warmup_fraction`` of its T/S updates, then cosine to the end; its τ is the one the
  rule assumes, S per update.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


STATE_DTYPES = (None, "bfloat16", "8bit")  # the momentum buffer's formats (fused_optim.state_formats)


@dataclass(frozen=True)
class Setup:
    """What every run shares: the baseline's batch, optimizer and budget."""

    batch_size: int = 8
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 1e-4
    budget: int = 1600  # T: the baseline's updates, every run's τ budget
    warmup_fraction: float = 0.1  # of a linear-scaling run's updates
    evaluations: int = 40  # validation points per run, evenly spaced in τ
    seed: int = 0
    state_dtype: str | None = None  # FusedSGD's momentum buffer: fp32 (None), "bfloat16" or "8bit"

    def __post_init__(self):
        if not (isinstance(self.lr, (int, float)) and 0 < self.lr < float("inf")):
            raise ValueError(f"Invalid lr: {self.lr!r} (a positive number: the baseline's learning rate)")
        if self.state_dtype not in STATE_DTYPES:
            raise ValueError(f"Invalid state_dtype: {self.state_dtype!r} (None for fp32 state, 'bfloat16' or '8bit')")

    def optimizer_options(self) -> dict:
        """FusedSGD's keyword arguments every run shares (state_dtype only when compact)."""
        compact = {} if self.state_dtype is None else dict(state_dtype=self.state_dtype)
        return dict(momentum=self.momentum, weight_decay=self.weight_decay, **compact)


QUICK = dict(budget=320, evaluations=16)


@dataclass(frozen=True)
class Run:
    """One training run. ``batch_size`` is per micro-batch and rank; an update pools
    ``world_size × accumulate`` micro-batches."""

    name: str  # file-safe, unique in a plan
    label: str  # for the table and the plot
    method: str  # "baseline", "adascale" or "linear"
    scale: int  # S
    world_size: int
    accumulate: int
    batch_size: int
    lr: float  # the peak lr of the schedule
    schedule_steps: int  # the cosine schedule's length: updates, or τ for AdaScale
    warmup_steps: int  # linear warm-up from lr/scale, inside schedule_steps
    max_steps: int  # updates at most
    tau_target: float | None  # AdaScale: stop once τ reaches it

    @property
    def nominal_gain(self) -> float | None:
        """τ per update a fixed-lr run assumes (1, or S under linear scaling); None: measured."""
        return None if self.method == "adascale" else float(self.scale)

    def to_dict(self) -> dict:
        return asdict(self)


def plan_runs(setup: Setup, scales: tuple[int, ...] = (4, 8)) -> list[Run]:
    """The runs in the order they train: the baseline, then per scale AdaScale and linear
    scaling; at the smallest even scale also AdaScale over 2 DDP ranks each accumulating S/2."""
    for s in scales:
        if not (isinstance(s, int) and s >= 2):
            raise ValueError(f"Invalid scale: {s!r} (an integer ≥ 2: the micro-batches per update)")
        if setup.budget % s:
            raise ValueError(f"Invalid scale: {s} does not divide the budget T = {setup.budget} "
                             f"(linear scaling runs T/S updates): pick scales that divide {setup.budget}")
    ddp_scale = min((s for s in scales if s % 2 == 0), default=None)
    t, b, lr = setup.budget, setup.batch_size, setup.lr
    runs = [Run("baseline", f"baseline B={b}", "baseline", 1, 1, 1, b, lr, t, 0, t, None)]
    for s in scales:
        runs.append(Run(f"adascale-s{s}", f"AdaScale S={s}", "adascale", s, 1, s, b, lr, t, 0, t, float(t)))
        if s == ddp_scale:
            runs.append(Run(f"adascale-s{s}-ddp", f"AdaScale S={s} (2 ranks × {s // 2})", "adascale", s, 2, s // 2,
                            b, lr, t, 0, t, float(t)))
        steps = t // s
        runs.append(Run(f"linear-s{s}", f"linear S={s} + warm-up", "linear", s, 1, 1, s * b, s * lr, steps,
                        max(1, round(setup.warmup_fraction * steps)), steps, None))
    return runs
