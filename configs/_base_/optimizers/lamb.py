# ColossalAI's non-fused Lamb (the pytorch-lamb algorithm).
optimizer = dict(type='mmengine_optim.Lamb', lr=1e-2, weight_decay=1e-2)
