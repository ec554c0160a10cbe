"""Dataloaders for Megatron runs: sharded over data-parallel ranks only (TP/PP peers of one model
replica read the same samples), one step's worth of micro-batches per batch."""

from __future__ import annotations

from accelerate.data_loader import prepare_data_loader
from torch.utils.data import DataLoader, RandomSampler

from ..errors import MegatronPluginConfigError


def check_dataloader(dataloader: DataLoader, plugin, dp_size: int) -> None:
    """Raise, before any process group exists, if the loader can't feed whole Megatron steps."""
    micro = dataloader.batch_size
    if micro is None:
        raise MegatronPluginConfigError(
            "DataLoader.batch_size", None, "Megatron runs need a fixed micro-batch size: pass batch_size=..., not a batch_sampler"
        )
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
    micro = dataloader.batch_size
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
