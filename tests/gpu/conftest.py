"""Tests marked `two_gpus` skip where fewer than two GPUs are visible; on a two-GPU machine
`python -m pytest -m two_gpus tests/gpu` runs exactly the backlog one GPU cannot."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.device_count() >= 2:
        return
    skip = pytest.mark.skip(reason="needs 2 GPUs")
    for item in items:
        if "two_gpus" in item.keywords:
            item.add_marker(skip)
