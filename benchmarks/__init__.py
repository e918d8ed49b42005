"""The benchmarks, apart from the library (not in the wheel; run from a clone): ``make bench`` or
``python -m benchmarks`` runs :mod:`.optimizers` (``--device cpu``: ours vs torch.optim and timm,
with :mod:`.adascale_overhead`, AdaScale's overhead vs fairscale's) or :mod:`.cuda`
(``--device cuda``); :mod:`.state_dtype`, :mod:`.master_weights`, :mod:`.distributed`,
:mod:`.offload`, :mod:`.offload_fsdp2` and :mod:`.cpu_lion_adagrad` (the CPU optimizers against
DeepSpeed's, and inside FSDP2's offload) also run on their own (``python -m benchmarks.state_dtype``). :mod:`.common` holds what they share. The
library never imports them."""
