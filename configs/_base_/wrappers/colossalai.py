# mmengine's ColossalAIOptimWrapper signature, without ColossalAI (a booster would be ignored): a
# FusedOptimWrapper. A config adds its optimizer: optim_wrapper = dict(optimizer={{_base_.optimizer}}).
optim_wrapper = dict(type='mmengine_optim.ColossalAIOptimWrapper', accumulative_counts=1)
