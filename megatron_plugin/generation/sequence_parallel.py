"""Decoding a model built with sequence parallelism.

Sequence parallelism splits each sequence over the TP ranks between the tensor-parallel regions; a decode
step feeds one token per row, which cannot be split. Training needs it (MoE layers with TP > 1 train only
with it, as megatron-core requires), and post-training loops generate with the model they train. So for
the duration of a generation the model runs as if built without it: every TransformerConfig the modules
hold and every module flag megatron-core and our layers read at run time (`sequence_parallel`,
`reduce_scatter_embeddings`) are turned off, and restored afterwards. The weights and their layout are
the same either way; only where activations are gathered and scattered changes.
"""

from __future__ import annotations

import contextlib

FLAGS = ("sequence_parallel", "reduce_scatter_embeddings")


@contextlib.contextmanager
def sequence_parallel_off(module):
    configs, flags = {}, []
    for m in module.modules():
        for attr in ("config", "model_config"):
            cfg = getattr(m, attr, None)
            if getattr(cfg, "sequence_parallel", False) is True:
                configs[id(cfg)] = cfg
        for attr in FLAGS:
            if vars(m).get(attr) is True:
                flags.append((m, attr))
    for cfg in configs.values():
        cfg.sequence_parallel = False
    for m, attr in flags:
        setattr(m, attr, False)
    try:
        yield
    finally:
        for cfg in configs.values():
            cfg.sequence_parallel = True
        for m, attr in flags:
            setattr(m, attr, True)
