# A float16 model with fp32 master weights inside FusedAdam's kernel (master_weights=True: the
# kernel reads the fp16 grads, updates the fp32 masters and moments, writes the fp16 params) and a
# dynamic loss scale, unscaled inside the same pass.
#   python -m mmengine_optim.train configs/digits_fused_adam_fp16_master.py
_base_ = [
    '_base_/default_runtime.py', '_base_/datasets/digits.py', '_base_/models/digits_cnn.py',
    '_base_/wrappers/fused.py',
]
# The digits dataset, model and metric are the examples': registered by importing their module.
custom_imports = dict(imports=['examples.mmengine_digits'], allow_failed_imports=False)
model = dict(dtype='float16')
optim_wrapper = dict(optimizer=dict(type='mmengine_optim.FusedAdam', lr=3e-3, weight_decay=1e-2, master_weights=True),
                     loss_scale='dynamic')
param_scheduler = [dict(type='CosineAnnealingLR', by_epoch=False, begin=0, end=300)]
train_cfg = dict(type='IterBasedTrainLoop', max_iters=300, val_interval=100)
