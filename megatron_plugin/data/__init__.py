"""Data the plugin reads itself: Megatron indexed datasets (`indexed`) and the tool that writes them
(`preprocess`)."""
