# A ColossalAI-style config without ColossalAI: CPUAdam with half of its moments in memory-mapped
# files, through ColossalAIOptimWrapper with 2 micro-batches per update.
#   python -m mmengine_optim.train configs/digits_colossalai_cpu_adam.py
_base_ = [
    '_base_/default_runtime.py', '_base_/datasets/digits.py', '_base_/models/digits_cnn.py',
    '_base_/wrappers/colossalai.py',
]
custom_imports = dict(imports=['examples.mmengine_digits'], allow_failed_imports=False)
optim_wrapper = dict(accumulative_counts=2, optimizer=dict(type='mmengine_optim.CPUAdam', lr=3e-3, weight_decay=1e-2,
                                                           nvme_offload_fraction=0.5))
param_scheduler = [dict(type='CosineAnnealingLR', by_epoch=False, begin=0, end=300)]
train_cfg = dict(type='IterBasedTrainLoop', max_iters=600, val_interval=200)
