"""Dataloaders for Megatron runs: sharded over data-parallel ranks only (TP/PP peers of one model
replica read the same samples), one step's worth of micro-batches per batch."""

from __future__ import annotations

from typing import Sequence

from accelerate.data_loader import prepare_data_loader
from torch.utils.data import DataLoader, RandomSampler

from ..data.indexed import consumed_samples
from ..errors import MegatronPluginConfigError


def micro_batch_size(loaders: Sequence[DataLoader], indexed: Sequence, plugin) -> int:
    """The run's micro-batch size, as accelerate's Megatron-LM integration chooses it: a Megatron indexed
    loader's own; else, over the torch loaders passed together (train and eval), the smallest batch size
    with `is_train_batch_min=True` (the default), the largest with False. Every torch loader is then
    re-batched to it (`prepare_megatron_dataloader`), as accelerate does. 0 when no loader has a batch
    size (`check_dataloader` refuses those)."""
    if indexed:
        return indexed[0].micro_batch_size
    sizes = [dl.batch_size for dl in loaders if dl.batch_size is not None]
    if not sizes:
        return 0
    return min(sizes) if getattr(plugin, "is_train_batch_min", True) else max(sizes)


def _micro(dataloader: DataLoader, plugin) -> int:
    """The micro-batch this loader is cut into: the resolved plugin's (`micro_batch_size`), else its own."""
    chosen = getattr(plugin, "micro_batch_size", None)
    return chosen if chosen and dataloader.batch_size is not None else dataloader.batch_size


def check_dataloader(dataloader: DataLoader, plugin, dp_size: int) -> None:
    """Raise, before any process group exists, if the loader can't feed whole Megatron steps."""
    if dataloader.batch_size is None:
        raise MegatronPluginConfigError(
            "DataLoader.batch_size", None, "Megatron runs need a fixed micro-batch size: pass batch_size=..., not a batch_sampler"
        )
    if any(consumed_samples(plugin)) and not getattr(plugin, "megatron_dataset_flag", False):
        raise MegatronPluginConfigError(
            "consumed_samples", plugin.consumed_samples,
            "it sets where Megatron indexed datasets (MegatronLMDummyDataLoader) start reading; a torch DataLoader "
            "starts at its beginning: skip batches with accelerator.skip_first_batches(loader, n), and leave "
            "consumed_samples unset",
        )
    micro = _micro(dataloader, plugin)
    step_batch = micro * plugin.num_micro_batches
    n = len(dataloader.dataset) if hasattr(dataloader.dataset, "__len__") else None
    if plugin.num_micro_batches > 1 and not dataloader.drop_last and n is not None and n % (step_batch * dp_size):
        raise MegatronPluginConfigError(
            "num_micro_batches", plugin.num_micro_batches,
            f"the last batch of the {n} samples would not split into {plugin.num_micro_batches} micro-batches of "
            f"{micro}: create the DataLoader with drop_last=True, or change the micro-batch size",
        )


def prepare_megatron_dataloader(dataloader: DataLoader, plugin, dp_size: int, dp_rank: int, device, seed: int):
    check_dataloader(dataloader, plugin, dp_size)
    micro = _micro(dataloader, plugin)
    step_batch = micro * plugin.num_micro_batches
    rebuilt = DataLoader(
        dataloader.dataset,
        batch_size=step_batch,
        shuffle=isinstance(dataloader.sampler, RandomSampler),
        collate_fn=dataloader.collate_fn,
        drop_last=dataloader.drop_last,
        num_workers=dataloader.num_workers,
        # pinned, so the copy to the GPU is queued without waiting: a pageable copy first waits for the
        # GPU to finish the previous step, which then idles while the host prepares the next one
        pin_memory=dataloader.pin_memory or device.type == "cuda",
    )
    prepared = prepare_data_loader(
        rebuilt,
        device=device,
        non_blocking=device.type == "cuda",
        num_processes=dp_size,
        process_index=dp_rank,
        split_batches=False,
        put_on_device=True,
        use_seedable_sampler=True,
        data_seed=seed,
    )
    prepared.micro_batch_size = micro
    return prepared
