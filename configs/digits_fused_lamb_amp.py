# FusedLAMB with float16 autocast and a dynamic loss scale, on the CPU too (mmengine's
# AmpOptimWrapper needs a GPU): the kernels unscale inside their update; clipping by the fused norm.
#   python -m mmengine_optim.train configs/digits_fused_lamb_amp.py
_base_ = [
    '_base_/default_runtime.py', '_base_/datasets/digits.py', '_base_/models/digits_cnn.py',
    '_base_/optimizers/fused_lamb.py', '_base_/wrappers/fused.py',
]
# The digits dataset, model and metric are the examples': registered by importing their module.
custom_imports = dict(imports=['examples.mmengine_digits'], allow_failed_imports=False)
optim_wrapper = dict(optimizer={{_base_.optimizer}}, loss_scale='dynamic', dtype='float16',
                     clip_grad=dict(max_norm=5.0))
param_scheduler = [
    dict(type='LinearLR', by_epoch=False, start_factor=0.1, begin=0, end=20),
    dict(type='CosineAnnealingLR', by_epoch=False, begin=20, end=300),
]
train_cfg = dict(type='IterBasedTrainLoop', max_iters=300, val_interval=100)
