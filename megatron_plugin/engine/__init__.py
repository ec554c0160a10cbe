"""The training engines (CPU and CUDA), their optimizer/scheduler adapters, data, process groups and checkpoints."""
