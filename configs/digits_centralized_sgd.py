# CentralizedSGD on N ranks: the optimizer averages the grads (flat buckets), the model is not in DDP.
#   torchrun --nproc_per_node=2 -m mmengine_optim.train configs/digits_centralized_sgd.py --launcher pytorch
# Any distributed optimizer fits here, e.g. optimizer=dict(type='mmengine_optim.PowerSGD', lr=0.1, rank=2)
# or dict(type='mmengine_optim.DecentralizedSGD', lr=0.1, neighbors='ring').
_base_ = ['_base_/default_runtime.py', '_base_/datasets/digits.py', '_base_/models/digits_cnn.py']
custom_imports = dict(imports=['examples.mmengine_digits'], allow_failed_imports=False)
model_wrapper_cfg = dict(type='mmengine_optim.OptimizerSyncedModel')
# every rank's params and optimizer state in the checkpoints (PowerSGD's error memories differ per rank)
custom_hooks = [dict(type='mmengine_optim.PortableCheckpointHook'),
                dict(type='mmengine_optim.PerRankCheckpointHook')]
optim_wrapper = dict(type='OptimWrapper',
                     optimizer=dict(type='mmengine_optim.CentralizedSGD', lr=0.1, momentum=0.9, weight_decay=1e-4))
param_scheduler = [dict(type='MultiStepLR', by_epoch=False, milestones=[200, 300], gamma=0.1)]
train_cfg = dict(type='IterBasedTrainLoop', max_iters=400, val_interval=100)
