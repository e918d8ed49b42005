"""Names of the AdaScale metrics that both framework adapters log (``lightning_optim`` through
``LightningModule.log``, ``mmengine_optim`` through the message hub as ``train/<name>``)."""

GAIN = "adascale/gain"  # the gain the last update applied (Δτ)
TAU = "adascale/tau"  # τ, the scale-invariant step count: the sum of the applied gains
LR = "adascale/lr"  # the lr the last update applied to the first param group: scheduled lr × gain
