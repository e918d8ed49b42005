optimizer = dict(type='mmengine_optim.FusedLAMB', lr=1e-2, betas=(0.9, 0.999), weight_decay=1e-2)
