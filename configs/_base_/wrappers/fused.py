# FusedOptimWrapper: clipping by the fused L2 norm and loss scaling unscaled inside the kernels.
# A config adds its optimizer: optim_wrapper = dict(optimizer={{_base_.optimizer}}).
optim_wrapper = dict(type='mmengine_optim.FusedOptimWrapper', accumulative_counts=1)
