# torch.optim.Adagrad's signature and defaults, fused (type='Adagrad' bare is torch's own).
optimizer = dict(type='mmengine_optim.Adagrad', lr=1e-2)
