# The digits CNN under mmengine's FSDPStrategy (FlexibleRunner; torch's FSDP1, flat params sharded
# across the ranks) stepped by FusedAdam on each rank's shard, on 2 CPU processes (gloo):
#   torchrun --nproc_per_node=2 -m mmengine_optim.train configs/fsdp/digits_fsdp_fused_adam.py --launcher pytorch
# (mmengine_optim.train builds a FlexibleRunner for a config with a strategy; on CPU it sets the
# wrapper's device_id='cpu' and starts gloo itself, see mmengine_optim.prepare_cpu_ddp.)
_base_ = [
    '../_base_/default_runtime.py', '../_base_/datasets/digits.py', '../_base_/models/digits_cnn.py',
    '../_base_/optimizers/fused_adam.py', '../_base_/wrappers/fused.py',
]
custom_imports = dict(imports=['examples.mmengine_digits'], allow_failed_imports=False)
strategy = dict(type='FSDPStrategy')
optim_wrapper = dict(optimizer={{_base_.optimizer}})
param_scheduler = [dict(type='MultiStepLR', by_epoch=False, milestones=[200, 300], gamma=0.1)]
train_cfg = dict(type='IterBasedTrainLoop', max_iters=400, val_interval=100)
