"""PyTorch Lightning adapter for fused_optim (strategy and callbacks arrive with the Lightning issue).

Today no adapter is needed: return fused_optim optimizers from ``configure_optimizers``.
"""
