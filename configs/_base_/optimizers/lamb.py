# ColossalAI's non-fused Lamb (the pytorch-lamb algorithm); ColossalAI's name 'Lamb' works too.
optimizer = dict(type='mmengine_optim.ColossalLamb', lr=1e-2, weight_decay=1e-2)
