# ColossalAI's Lars (the trust ratio scales the lr); ColossalAI's name 'Lars' works too.
optimizer = dict(type='mmengine_optim.ColossalLars', lr=0.5, momentum=0.9, weight_decay=1e-4)
