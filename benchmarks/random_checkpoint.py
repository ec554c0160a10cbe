"""A random HF checkpoint of any size, written shard by shard (one shard in memory at a time), with the
safetensors index that `from_pretrained` and our readers expect. Shared by the memory and conversion
benchmarks, whose models are too big to build whole first."""

import json
import os


def write_random_checkpoint(path, model_cls, config, shard_bytes, dtype=None, device="cpu", skip=(), seed=0):
    """Weights ~ N(0, 0.02) in `dtype` (default: fp32), drawn on `device`, for every tensor of
    `model_cls(config)` but the names in `skip` (tied copies). Returns (total bytes, largest shard bytes)."""
    import torch
    from safetensors.torch import save_file

    dtype = dtype or torch.float32
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in model_cls(config).state_dict().items() if k not in skip}
    os.makedirs(path, exist_ok=True)
    config.save_pretrained(path)
    g = torch.Generator(device=device).manual_seed(seed)
    weight_map, total, current, size = {}, 0, {}, 0

    def flush():
        nonlocal current, size
        file = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
        save_file(current, os.path.join(path, file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(current, file))
        current, size = {}, 0

    for name, shape in shapes.items():
        t = (torch.randn(shape, generator=g, device=device) * 0.02).to(dtype).cpu()
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > shard_bytes:
            flush()
        current[name] = t
        size += nbytes
        total += nbytes
    flush()
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    return total, max(os.path.getsize(os.path.join(path, f)) for f in set(weight_map.values()))


def has_checkpoint(path) -> bool:
    return os.path.exists(os.path.join(path, "model.safetensors.index.json"))
