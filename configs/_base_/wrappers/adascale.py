# AdaScale at scale 4: each update pools 4 micro-batches (accumulative_counts; times the ranks
# under DDP) and multiplies the lr by the gain. Schedules follow τ through the default runtime's
# UpdateParamSchedulerHook. A config adds its optimizer: optim_wrapper = dict(optimizer=...).
optim_wrapper = dict(type='mmengine_optim.AdaScaleOptimWrapper', accumulative_counts=4)
