optimizer = dict(type='mmengine_optim.SignSGD', lr=1e-3, momentum=0.9)
