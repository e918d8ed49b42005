# Lion (lion-pytorch's defaults but lr), fused; also reachable bare as type='Lion'.
optimizer = dict(type='mmengine_optim.Lion', lr=1e-4, betas=(0.9, 0.99), weight_decay=1e-2)
