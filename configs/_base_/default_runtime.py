# Runtime shared by the example configs: iteration-based schedules that count optimizer updates
# (τ with AdaScale), checkpoints that load under torch.load(weights_only=True).
default_scope = 'mmengine'
default_hooks = dict(
    runtime_info=dict(type='RuntimeInfoHook'),
    timer=dict(type='IterTimerHook'),
    logger=dict(type='LoggerHook', interval=10),
    param_scheduler=dict(type='mmengine_optim.UpdateParamSchedulerHook'),
    checkpoint=dict(type='CheckpointHook', by_epoch=False, interval=100),
    sampler_seed=dict(type='DistSamplerSeedHook'),
)
custom_hooks = [dict(type='mmengine_optim.PortableCheckpointHook')]
env_cfg = dict(cudnn_benchmark=False, mp_cfg=dict(mp_start_method='fork', opencv_num_threads=0),
               dist_cfg=dict(backend='gloo'))
log_processor = dict(by_epoch=False, window_size=10)
log_level = 'INFO'
randomness = dict(seed=0)
load_from = None
resume = False
