# Bare names after custom_imports, and paramwise_cfg (one param group per tensor: no weight decay
# on biases). adamw is fused_optim.FusedAdam in AdamW mode; AdaScale's gain is global over the groups.
#   python -m mmengine_optim.train configs/digits_adamw_paramwise.py
_base_ = [
    '_base_/default_runtime.py', '_base_/datasets/digits.py', '_base_/models/digits_cnn.py',
]
custom_imports = dict(imports=['mmengine_optim', 'examples.mmengine_digits'], allow_failed_imports=False)
optim_wrapper = dict(type='AdaScaleOptimWrapper', accumulative_counts=2,
                     optimizer=dict(type='adamw', lr=3e-3, weight_decay=1e-2),
                     paramwise_cfg=dict(bias_decay_mult=0.0))
param_scheduler = [dict(type='CosineAnnealingLR', by_epoch=False, begin=0, end=300)]
train_cfg = dict(type='IterBasedTrainLoop', max_iters=600, val_interval=200)
