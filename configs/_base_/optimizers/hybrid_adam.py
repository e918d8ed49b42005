# ColossalAI's HybridAdam: CPUAdam stepping CPU and CUDA params in one optimizer.
optimizer = dict(type='mmengine_optim.HybridAdam', lr=3e-3, weight_decay=1e-2)
