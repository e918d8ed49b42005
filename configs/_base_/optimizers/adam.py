# torch.optim.Adam's signature and defaults, fused (type='Adam' bare is torch's own).
optimizer = dict(type='mmengine_optim.Adam', lr=1e-3)
