# LARS as quadra / timm's Lars.
optimizer = dict(type='mmengine_optim.LARS', lr=0.5, momentum=0.9, weight_decay=1e-4)
