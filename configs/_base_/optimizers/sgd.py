# torch.optim.SGD's signature and defaults, fused (type='SGD' bare is torch's own).
optimizer = dict(type='mmengine_optim.SGD', lr=0.1, momentum=0.9, weight_decay=1e-4)
