# ColossalAI's CPUAdam: AdamW (adamw_mode=True) with bias_correction; nvme_offload_fraction keeps
# that share of the moments in memory-mapped files (nvme_offload_dir).
optimizer = dict(type='mmengine_optim.CPUAdam', lr=3e-3, weight_decay=1e-2)
