# ColossalAI's Lars (the trust ratio scales the lr).
optimizer = dict(type='mmengine_optim.Lars', lr=0.5, momentum=0.9, weight_decay=1e-4)
