# AdamW (decoupled_weight_decay=True, apex/ColossalAI's default, their adam_w_mode); False for Adam.
optimizer = dict(type='mmengine_optim.FusedAdam', lr=3e-3, betas=(0.9, 0.999), weight_decay=1e-2)
