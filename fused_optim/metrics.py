"""Names of the metrics that both framework adapters log (``lightning_optim`` through
``LightningModule.log``, ``mmengine_optim`` through the message hub as ``train/<name>``)."""

GAIN = "adascale/gain"  # the gain the last update applied (Δτ)
TAU = "adascale/tau"  # τ, the scale-invariant step count: the sum of the applied gains
LR = "adascale/lr"  # the lr the last update applied to the first param group: scheduled lr × gain

# The gradient noise scale (fused_optim.NoiseScale, or AdaScale's), logged under the same names:
NOISE_SCALE = "noise_scale/b_simple"  # B_simple, in samples
BATCH = "noise_scale/batch"  # the batch of the last update: N·c·B_micro samples
SUGGESTED_BATCH = "noise_scale/suggested_batch"  # N·c·B_micro for the suggested c (≤ B_simple)
