# AdamW with 8-bit moments (state_dtype='8bit': blockwise, one fp32 absmax per 256 elements and a
# byte per element; fused_optim/state_formats.py): a quarter of the fp32 state's memory.
#   python -m mmengine_optim.train configs/digits_adamw_8bit_state.py
_base_ = [
    '_base_/default_runtime.py', '_base_/datasets/digits.py', '_base_/models/digits_cnn.py',
    '_base_/wrappers/fused.py',
]
# The digits dataset, model and metric are the examples': registered by importing their module.
custom_imports = dict(imports=['examples.mmengine_digits'], allow_failed_imports=False)
optim_wrapper = dict(optimizer=dict(type='mmengine_optim.AdamW', lr=3e-3, weight_decay=1e-2, state_dtype='8bit'))
param_scheduler = [dict(type='CosineAnnealingLR', by_epoch=False, begin=0, end=300)]
train_cfg = dict(type='IterBasedTrainLoop', max_iters=300, val_interval=100)
