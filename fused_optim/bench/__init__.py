"""What ``fused-optim bench`` runs: :mod:`.optimizers` (``--device cpu``: ours vs torch.optim and timm,
with :mod:`.adascale_overhead`, AdaScale's overhead vs fairscale's) and :mod:`.cuda` (``--device cuda``).
Imported by the CLI only: the optimizers never import their benchmarks."""
