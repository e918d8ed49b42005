# AdaScale at scale 4 (batch 4×32 through accumulative_counts=4) on the baseline's schedule in τ:
# the lr steps at τ = 200 and 300 and training stops at τ = 400 (a checkpoint is saved there).
# With gain g per update that takes about 400/g updates instead of 400·4 micro-batch updates.
#   python -m mmengine_optim.train configs/digits_fused_sgd_adascale.py
_base_ = [
    '_base_/default_runtime.py', '_base_/datasets/digits.py', '_base_/models/digits_cnn.py',
    '_base_/optimizers/fused_sgd.py', '_base_/wrappers/adascale.py',
]
# The digits dataset, model and metric are the examples': registered by importing their module.
custom_imports = dict(imports=['examples.mmengine_digits'], allow_failed_imports=False)
optim_wrapper = dict(optimizer={{_base_.optimizer}})
param_scheduler = [dict(type='MultiStepLR', by_epoch=False, milestones=[200, 300], gamma=0.1)]
default_hooks = dict(param_scheduler=dict(max_scale_invariant_iters=400),
                     checkpoint=dict(interval=400))
train_cfg = dict(type='IterBasedTrainLoop', max_iters=1600, val_interval=400)
