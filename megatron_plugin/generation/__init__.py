"""Text generation with the Megatron model."""
