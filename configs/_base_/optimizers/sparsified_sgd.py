# mlbench's SparsifiedSGD: error feedback, k coordinates per tensor.
optimizer = dict(type='mmengine_optim.SparsifiedSGD', lr=0.1, sparse_grad_size=64)
