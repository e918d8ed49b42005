"""mmengine adapter for fused_optim (registries and optimizer wrappers arrive with the mmengine issue)."""
