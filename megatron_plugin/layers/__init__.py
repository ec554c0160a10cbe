"""Modules we put into Megatron-Core's layer specs in place of its CUDA-bound or TE/apex-bound ones,
the specs themselves, and the vocab-parallel loss and gathers."""
