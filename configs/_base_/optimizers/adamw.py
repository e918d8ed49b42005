# torch.optim.AdamW's signature and defaults (weight_decay=1e-2), fused (type='AdamW' bare is torch's own).
optimizer = dict(type='mmengine_optim.AdamW', lr=1e-3)
