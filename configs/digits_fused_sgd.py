# Baseline: FusedSGD with momentum, batch 32, 400 updates, lr steps at updates 200 and 300.
#   python -m mmengine_optim.train configs/digits_fused_sgd.py
_base_ = [
    '_base_/default_runtime.py', '_base_/datasets/digits.py', '_base_/models/digits_cnn.py',
    '_base_/optimizers/fused_sgd.py', '_base_/wrappers/fused.py',
]
# The digits dataset, model and metric are the examples': registered by importing their module.
custom_imports = dict(imports=['examples.mmengine_digits'], allow_failed_imports=False)
optim_wrapper = dict(optimizer={{_base_.optimizer}}, clip_grad=dict(max_norm=10.0))
param_scheduler = [dict(type='MultiStepLR', by_epoch=False, milestones=[200, 300], gamma=0.1)]
train_cfg = dict(type='IterBasedTrainLoop', max_iters=400, val_interval=100)
