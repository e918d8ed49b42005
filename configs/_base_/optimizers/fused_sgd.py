optimizer = dict(type='mmengine_optim.FusedSGD', lr=0.1, momentum=0.9, weight_decay=1e-4)
