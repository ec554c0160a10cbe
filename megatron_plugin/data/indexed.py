"""Megatron indexed datasets (.bin/.idx, as Megatron-LM's preprocess_data.py and `megatron-plugin
preprocess-data` write them) behind the guide's `MegatronLMDummyDataLoader`.

megatron-core's GPTDataset makes the samples (blends, train/valid/test splits, shuffling, cached
indices); each data-parallel rank then reads its part of every global batch in Megatron-LM's order
(MegatronPretrainingSampler), so a run sees the samples Megatron-LM would. Batches are HF batches the
GPT step takes: `input_ids`, `shift_labels` (Megatron's labels are already the next tokens; -100 where
its loss mask is 0) and, with reset_position_ids, `position_ids` (restarts = packed documents)."""

from __future__ import annotations

import numbers
import os
from typing import Optional

import torch
from torch.utils.data import DataLoader

from train_steps.gpt import IGNORE_INDEX

from ..errors import MegatronPluginConfigError
from ..fs import check_writable

SETTING = "MegatronLMDummyDataLoader"

# name: (default, help). Names are Megatron-LM's argument names, as the guide passes them.
ARGS = {
    "data_path": (None, "a dataset prefix (the path without .bin/.idx), a list of them, or Megatron's blend "
                        "list ['0.7', 'prefix_a', '0.3', 'prefix_b']"),
    "split": ("969, 30, 1", "train/valid/test weights over data_path's documents (Megatron's --split)"),
    "seq_length": (None, "tokens per sample"),
    "micro_batch_size": (None, "samples per micro-batch on each data-parallel rank"),
    "seed": (1234, "seed of the sample shuffle (Megatron's --seed)"),
    "num_workers": (0, "DataLoader worker processes reading samples"),
    "data_cache_path": (None, "folder for the cached sample indices; default <prefix>/cache beside the data"),
    "mmap_bin_files": (True, "memory-map the .bin files (else read them with file reads)"),
    "reset_position_ids": (False, "positions restart after each end-of-document token (with reset_attention_mask)"),
    "reset_attention_mask": (False, "documents of one sample do not attend to each other (with reset_position_ids)"),
    "eod_mask_loss": (False, "no loss for predicting the token after an end-of-document token"),
    "eod_token_id": (None, "the end-of-document id the data was written with; default the model's eos_token_id"),
    "train_data_path": (None, "the train split's own blend (with valid/test_data_path, instead of data_path)"),
    "valid_data_path": (None, "the validation split's own blend"),
    "test_data_path": (None, "the test split's own blend"),
    "train_iters": (None, "training steps; default the MegatronLMDummyScheduler's total_num_steps"),
    "eval_iters": (None, "batches per evaluation; default MegatronLMPlugin.eval_iters"),
    "eval_interval": (None, "steps between evaluations; default MegatronLMPlugin.eval_interval"),
}
ALIASES = {"splits_string": "split"}  # the guide's name for Megatron's --split
SPLITS = ("train", "valid", "test")


def _items(blend) -> list:
    """A data_path value as Megatron's blend list of strings: a string is split at whitespace (Megatron's
    --data-path), unless it is itself the prefix of a .bin/.idx pair (a path with a space in it)."""
    if isinstance(blend, str):
        return [blend] if os.path.isfile(blend + ".idx") else blend.split()
    return [os.fspath(p) if isinstance(p, os.PathLike) else str(p) for p in blend]


def _weighted(blend) -> tuple:
    """(prefixes, weights or None) of a data_path value (a prefix, a list of prefixes, or a weighted blend list)."""
    items = _items(blend)
    if len(items) % 2 == 0 and items and all(_is_number(w) for w in items[::2]):
        return items[1::2], [float(w) for w in items[::2]]
    return items, None


def _prefixes(blend) -> list:
    return _weighted(blend)[0]


def _split_weights(split) -> list:
    """Megatron's --split string ('949,50,1' or '949/50/1') as its text parts."""
    return str(split).replace("/", ",").split(",")


def _is_number(x) -> bool:
    try:
        float(x)
        return True
    except (TypeError, ValueError):
        return False


def _readable(prefix: str, error: MegatronPluginConfigError) -> int:
    """Open the pair now, so a damaged file is refused before distributed work (in prepare it would fail
    on rank 0 only, while the others wait for it). Returns its number of documents."""
    from megatron.core.datasets.indexed_dataset import _INDEX_HEADER, IndexedDataset

    try:
        with open(prefix + ".idx", "rb") as f:
            if f.read(len(_INDEX_HEADER)) != _INDEX_HEADER:  # mcore's reader would assert, then warn twice on cleanup
                raise ValueError("the .idx does not start with Megatron's index header")
        data = IndexedDataset(prefix)
        if len(data) == 0 or int(data.sequence_lengths.sum()) * data.index.dtype_size > os.path.getsize(prefix + ".bin"):
            raise ValueError("the .bin is shorter than the .idx says")
    except Exception as err:
        raise MegatronPluginConfigError(error.setting, error.value, f"{error.fix} ({type(err).__name__}: {err}): "
                                        "write it again with `megatron-plugin preprocess-data`") from None
    return len(data)


def _split_ranges(split, documents: int) -> list:
    """[begin, end) documents of the train, valid and test splits of a dataset of `documents` documents
    (None for a split of weight 0), as megatron-core's builder cuts them."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )

    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(str(split)))
    return [None if m is None else (int(round(m[0] * documents)), int(round(m[1] * documents))) for m in matrix]


def consumed_samples(plugin) -> list:
    """The plugin's `consumed_samples` as [train, valid, test] (accelerate pads a shorter list with 0s):
    samples each split's iterator skips, as Megatron-LM's samplers start at consumed_*_samples."""
    value = getattr(plugin, "consumed_samples", None)
    if value is None:
        return [0, 0, 0]
    if (not isinstance(value, (list, tuple)) or not 1 <= len(value) <= 3
            or not all(isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= 0 for v in value)):
        raise MegatronPluginConfigError(
            "consumed_samples", value, "pass a list of up to three whole numbers >= 0: the train, valid and test "
                                       "samples already consumed, e.g. [2048] or [2048, 64, 0]",
        )
    return [int(v) for v in value] + [0] * (3 - len(value))


def _blend(value):
    from megatron.core.datasets.utils import get_blend_from_list

    return None if value is None else get_blend_from_list(_items(value))


class MegatronLMDummyDataLoader:
    """Megatron indexed datasets for `accelerator.prepare`, as in accelerate's guide:

        megatron_dataloader = MegatronLMDummyDataLoader(data_path=..., splits_string="949,50,1",
                                                        seq_length=1024, micro_batch_size=4)
        model, optimizer, lr_scheduler, train_it, eval_it, test_it = accelerator.prepare(
            model, optimizer, lr_scheduler, megatron_dataloader, megatron_dataloader, megatron_dataloader)

    The same object passed once, twice or three times gives the train, validation and test iterators, in
    that order. Settings are Megatron-LM's argument names (`ARGS`); they are checked here, before any
    distributed work. The datasets are built in `prepare`, sized as Megatron sizes them: train_iters
    global batches for training, (train_iters // eval_interval + 1) * eval_iters for validation and
    eval_iters for test."""

    def __init__(self, **dataset_args):
        unknown = sorted(set(dataset_args) - set(ARGS) - set(ALIASES))
        if unknown:
            raise MegatronPluginConfigError(
                f"{SETTING}({unknown[0]}=...)", dataset_args[unknown[0]],
                f"not a setting of Megatron indexed datasets here; the settings are {sorted(ARGS)} (global batch "
                "size is micro_batch_size x MegatronLMPlugin.num_micro_batches x data-parallel size)",
            )
        args = {k: default for k, (default, _) in ARGS.items()}
        for alias, name in ALIASES.items():
            if alias in dataset_args:
                if name in dataset_args and str(dataset_args[name]) != str(dataset_args[alias]):
                    raise MegatronPluginConfigError(
                        f"{SETTING}({alias}=...)", dataset_args[alias],
                        f"it and {name}={dataset_args[name]!r} name the same setting: pass one of them",
                    )
                args[name] = dataset_args[alias]
        args.update({k: v for k, v in dataset_args.items() if k in ARGS})
        # pathlib paths are taken as the strings they name
        args.update({k: os.fspath(v) for k, v in args.items() if k.endswith("_path") and isinstance(v, os.PathLike)})
        self.given = set(dataset_args)
        self.documents = {}  # prefix: its number of documents
        self.dataset_args = args
        self._check()

    @property
    def micro_batch_size(self) -> int:
        return self.dataset_args["micro_batch_size"]

    def _bad(self, name, fix):
        return MegatronPluginConfigError(f"{SETTING}({name}=...)", self.dataset_args[name], fix)

    def _check(self):
        a = self.dataset_args
        for name in ("seq_length", "micro_batch_size"):
            if a[name] is None:
                raise self._bad(name, "required: pass it (a whole number >= 1)")
        for name, low in (("seq_length", 1), ("micro_batch_size", 1), ("seed", 0), ("num_workers", 0),
                          ("train_iters", 1), ("eval_iters", 0), ("eval_interval", 1), ("eod_token_id", 0)):
            v = a[name]
            if v is not None and (not isinstance(v, numbers.Integral) or isinstance(v, bool) or v < low):
                raise self._bad(name, f"use a whole number >= {low}")
            a[name] = None if v is None else int(v)  # numpy integers as well
        for name in ("mmap_bin_files", "reset_position_ids", "reset_attention_mask", "eod_mask_loss"):
            if not isinstance(a[name], bool):
                raise self._bad(name, "use True or False")
        if a["reset_position_ids"] != a["reset_attention_mask"]:
            raise self._bad(
                "reset_position_ids",
                f"with reset_attention_mask={a['reset_attention_mask']}: set both or neither. Restarting positions "
                "is what tells the model where a packed document starts (HF semantics), so documents of one sample "
                "are kept apart exactly when their positions restart",
            )
        per_split = [f"{s}_data_path" for s in SPLITS if a[f"{s}_data_path"] is not None]
        if per_split and a["data_path"] is not None:
            raise self._bad("data_path", f"pass either data_path (with split) or {per_split}, not both")
        if per_split and ("split" in self.given or "splits_string" in self.given):
            raise self._bad("split", f"{per_split} give each split its own data: leave split out")
        if not per_split and a["data_path"] is None:
            raise self._bad("data_path", "required: the prefix of a .bin/.idx pair (write one with "
                                         "`megatron-plugin preprocess-data`), or train/valid/test_data_path")
        paths = per_split or ["data_path"]
        for name in paths:
            value = a[name]
            if not isinstance(value, (str, list, tuple)) or not value:
                raise self._bad(name, "pass a prefix string or a list (of prefixes, or of weights and prefixes)")
            prefixes, weights = _weighted(value)
            if weights is not None and min(weights) <= 0:  # megatron-core's BlendedDataset asserts it
                raise self._bad(name, "a blend's weights must be > 0 (leave out a prefix to drop it): e.g. "
                                      "['0.7', 'prefix_a', '0.3', 'prefix_b']")
            if weights is None and any(_is_number(p) and not os.path.isfile(p + ".idx") for p in prefixes):
                raise self._bad(name, "a blend list alternates weight and prefix, a weight before every prefix: "
                                      "e.g. ['0.7', 'prefix_a', '0.3', 'prefix_b']")
            for prefix in prefixes:
                missing = [ext for ext in (".bin", ".idx") if not os.path.isfile(prefix + ext)]
                if missing:
                    raise self._bad(
                        name, f"{prefix}{missing[0]} does not exist: data_path takes the prefix of a .bin/.idx pair "
                              "(the path without the extension), e.g. the one `megatron-plugin preprocess-data` prints",
                    )
                self.documents[prefix] = _readable(
                    prefix, self._bad(name, f"{prefix}.idx/.bin is not a readable Megatron indexed dataset"))
        if not per_split:
            weights = _split_weights(a["split"])
            if (len(weights) > 3 or not all(_is_number(w) and float(w) >= 0 for w in weights)
                    or sum(float(w) for w in weights) <= 0):
                raise self._bad("split", "use up to three non-negative train,valid,test weights, e.g. '949,50,1'")
        cache = a["data_cache_path"]
        if cache is None:
            for prefix in {p for name in paths for p in _prefixes(a[name])}:
                check_writable(os.path.join(prefix, "cache"), f"{SETTING}(data_cache_path=None): the default cache beside {prefix}")
        else:
            check_writable(cache, f"{SETTING}(data_cache_path=...)")

    # -- at prepare ---------------------------------------------------------------------------------
    def check_for(self, hf_config, family, plugin, scheduler, wanted: int) -> dict:
        """Before any distributed work: what the model and the run need from the data. Returns the
        resolved sizes and end-of-document id."""
        a = self.dataset_args
        if family.train_step != "GPTTrainStep":
            raise MegatronPluginConfigError(
                SETTING, f"with a {family.name} model",
                "Megatron indexed datasets here make causal-LM samples (GPT, Llama families): for other models "
                "pass torch DataLoaders of HF batches",
            )
        limit = family.position_limit(hf_config)
        if limit is not None and a["seq_length"] > limit:
            raise self._bad("seq_length", f"the model has {limit} positions: use seq_length <= {limit}")
        g = plugin.global_batch_size
        train_iters = (a["train_iters"] or (getattr(scheduler, "total_num_steps", None) if scheduler is not None else None)
                       or getattr(plugin, "train_iters", None)
                       or (plugin.train_samples // g if getattr(plugin, "train_samples", None) else None))
        if not train_iters:
            raise self._bad(
                "train_iters", "the number of training steps sizes the train split: pass "
                "MegatronLMDummyScheduler(optimizer, total_num_steps=...) to the same prepare call, or train_iters here "
                "(or the plugin's train_iters/train_samples)",
            )
        eod = a["eod_token_id"]
        if eod is None:  # the model's eos (the first, if the config lists several)
            eos = getattr(hf_config, "eos_token_id", None)
            eod = (eos[0] if eos else None) if isinstance(eos, (list, tuple)) else eos
        if eod is None and (a["reset_position_ids"] or a["eod_mask_loss"]):
            raise self._bad("eod_token_id", "the model config has no eos_token_id to find document ends by: pass "
                                            "the id the data was written with (its tokenizer's eos)")
        if eod is not None and not 0 <= eod < hf_config.vocab_size:
            source = "" if a["eod_token_id"] is not None else " (the model config's eos_token_id)"
            raise MegatronPluginConfigError(
                f"{SETTING}(eod_token_id=...)", eod,
                f"end-of-document id {eod}{source} is outside the model's vocabulary of {hf_config.vocab_size}: pass "
                "the id the data was written with (its tokenizer's eos)",
            )
        eval_iters = a["eval_iters"] if a["eval_iters"] is not None else plugin.eval_iters
        eval_interval = a["eval_interval"] or plugin.eval_interval
        for i in range(wanted):  # megatron-core would loop forever over a split without documents
            why = self._why_empty(i)
            if why is not None:
                fix = ("give it data: a train weight in split (e.g. '949,50,1'), or train_data_path" if i == 0 else
                       "give it a weight (e.g. '949,50,1') or data, or pass the loader fewer times")
                raise self._bad(
                    "split" if a["data_path"] is not None else f"{SPLITS[i]}_data_path",
                    f"prepare was asked for a {SPLITS[i]} iterator (this loader passed {wanted} times), but that split "
                    f"has no data ({why}): {fix}",
                )
        if wanted > 1 and eval_iters == 0:
            raise self._bad("eval_iters", "an evaluation iterator was asked for, with 0 batches per evaluation: "
                                          "set eval_iters >= 1 (here or in MegatronLMPlugin)")
        consumed = consumed_samples(plugin)
        sizes = split_samples(int(train_iters), int(eval_iters), int(eval_interval), g)
        for i in range(wanted):
            if consumed[i] and consumed[i] + g > sizes[i]:  # Megatron-LM's sampler asserts it
                raise MegatronPluginConfigError(
                    "consumed_samples", plugin.consumed_samples,
                    f"the {SPLITS[i]} split is built for {sizes[i]} samples ({sizes[i] // g} global batches of {g}), "
                    f"and {consumed[i]} are already consumed: not one global batch is left. Lower "
                    f"consumed_samples[{i}], or raise the run's steps",
                )
        return {"train_iters": int(train_iters), "eval_iters": int(eval_iters), "eval_interval": int(eval_interval),
                "eod": -1 if eod is None else int(eod), "vocab_size": int(hf_config.vocab_size)}

    def _why_empty(self, i: int) -> Optional[str]:
        """Why split `i` has no documents (in some prefix of the blend); None when it has some."""
        a = self.dataset_args
        if a["data_path"] is None:
            return None if a[f"{SPLITS[i]}_data_path"] is not None else f"{SPLITS[i]}_data_path is not set"
        for prefix in _prefixes(a["data_path"]):
            documents = self.documents[prefix]
            cut = _split_ranges(a["split"], documents)[i]
            if cut is None:
                return f"its weight in split={a['split']!r} is 0"
            if cut[0] == cut[1]:
                return f"split={a['split']!r} gives it none of the {documents} documents of {prefix}"
        return None

    def build(self, resolved: dict, plugin, layout, device, wanted: int) -> list:
        """Collective (megatron-core builds the cached indices on rank 0 first). The train, validation and
        test iterators, `wanted` of them."""
        from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
        from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

        a = self.dataset_args
        per_split = a["data_path"] is None
        config = GPTDatasetConfig(
            random_seed=a["seed"], sequence_length=a["seq_length"],
            blend=None if per_split else _blend(a["data_path"]),
            blend_per_split=[_blend(a[f"{s}_data_path"]) if i < wanted else None for i, s in enumerate(SPLITS)]
            if per_split else None,
            split=None if per_split else str(a["split"]),
            path_to_cache=a["data_cache_path"], mmap_bin_files=a["mmap_bin_files"],
            tokenizer=_DocumentEnds(resolved["eod"], resolved["vocab_size"]),
            reset_position_ids=a["reset_position_ids"], reset_attention_mask=a["reset_attention_mask"],
            eod_mask_loss=a["eod_mask_loss"], create_attention_mask=False,
        )
        if not per_split:  # the splits not asked for are not built (their documents stay where split puts them)
            config.split_matrix = [m if i < wanted else None for i, m in enumerate(config.split_matrix)]
        g = plugin.global_batch_size
        sizes = split_samples(resolved["train_iters"], resolved["eval_iters"], resolved["eval_interval"], g)
        sizes = [n if i < wanted else 0 for i, n in enumerate(sizes)]
        datasets = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()
        consumed = consumed_samples(plugin)
        return [
            MegatronBatches(datasets[i], a["micro_batch_size"], plugin.num_micro_batches, layout.dp_size, layout.dp_rank,
                            device, a["num_workers"], cyclic=i > 0, positions=a["reset_position_ids"], split=SPLITS[i],
                            consumed=consumed[i])
            for i in range(wanted)
        ]


def split_samples(train_iters: int, eval_iters: int, eval_interval: int, global_batch: int) -> list:
    """Samples of the train, validation and test splits, as Megatron-LM sizes them
    (train_valid_test_num_samples): the run's global batches, its evaluations' and one evaluation's."""
    evals = train_iters // eval_interval + 1
    return [train_iters * global_batch, evals * eval_iters * global_batch, eval_iters * global_batch]


class _DocumentEnds:
    """What GPTDataset asks of a tokenizer: the end-of-document id (and the vocabulary size)."""

    def __init__(self, eod: int, vocab_size: int):
        self.eod, self.vocab_size = eod, vocab_size
        self.unique_identifiers = {"class": "DocumentEnds", "eod": eod}


class MegatronBatches:
    """One data-parallel rank's step batches from a GPTDataset, [micro_batch_size * num_micro_batches,
    seq_length] each. Step i's micro-batch j holds samples c + i*G + j*micro*dp + rank*micro + (0..micro-1),
    G the global batch and c the split's `consumed_samples`: Megatron-LM's MegatronPretrainingSampler order,
    from its consumed samples on. The train iterator stops after the samples built for train_iters steps;
    validation and test wrap around (to sample c). `position` (steps taken after c) is set from the
    checkpoint's iteration by `accelerator.load_state`, as Megatron-LM resumes from its consumed samples."""

    def __init__(self, dataset, micro: int, num_micro: int, dp_size: int, dp_rank: int, device, num_workers: int,
                 cyclic: bool, positions: bool, split: str, consumed: int = 0):
        self.dataset, self.micro, self.num_micro = dataset, micro, num_micro
        self.dp_size, self.dp_rank, self.device = dp_size, dp_rank, device
        self.num_workers, self.cyclic, self.positions, self.split = num_workers, cyclic, positions, split
        self.micro_batch_size = micro
        self.global_batch = micro * num_micro * dp_size
        self.consumed = consumed
        self.position = 0
        self._it = None

    def __len__(self) -> int:
        """Whole steps the dataset holds after its consumed samples."""
        return max(len(self.dataset) - self.consumed, 0) // self.global_batch

    def __iter__(self):
        return self

    def indices(self, step: int) -> list:
        start = self.consumed + step * self.global_batch
        per_micro = self.micro * self.dp_size
        return [start + j * per_micro + self.dp_rank * self.micro + e
                for j in range(self.num_micro) for e in range(self.micro)]

    def _steps(self):
        step = self.position
        while True:
            if step >= len(self):
                if not self.cyclic or len(self) == 0:
                    return
                step = 0
            yield self.indices(step)
            step += 1

    def __next__(self):
        if self._it is None:
            loader = DataLoader(self.dataset, batch_sampler=_Steps(self), num_workers=self.num_workers,
                                collate_fn=self._collate, pin_memory=self.device.type == "cuda")
            self._it = iter(loader)
        try:
            batch = next(self._it)
        except StopIteration:  # past the train split's end, like a DataLoader; the message says why for next()
            raise StopIteration(
                f"the {self.split} iterator has given all {len(self)} steps it was built for: its size comes from "
                "the dummy scheduler's total_num_steps (or train_iters); raise it to train longer"
            ) from None
        self.position += 1
        if self.cyclic and self.position >= len(self):
            self.position = 0
        return {k: v.to(self.device, non_blocking=self.device.type == "cuda") for k, v in batch.items()}

    def _collate(self, samples):
        tokens = torch.stack([s["tokens"] for s in samples])
        labels = torch.stack([s["labels"] for s in samples])
        loss_mask = torch.stack([s["loss_mask"] for s in samples])
        batch = {"input_ids": tokens, "shift_labels": labels.masked_fill(loss_mask == 0, IGNORE_INDEX)}
        if self.positions:
            batch["position_ids"] = torch.stack([s["position_ids"] for s in samples])
        return batch

    # resuming: where the next batch starts
    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.seek(int(state["position"]))

    def seek(self, step: int) -> None:
        """Continue at step `step` (the next batch is that step's)."""
        self.position = step % len(self) if self.cyclic and len(self) else step
        self._it = None  # workers may have read ahead of the old position


class _Steps:
    """A batch sampler over MegatronBatches' steps from its position when iterated: a new DataLoader
    iterator starts where `seek` put it (its workers read ahead; `position` counts what was handed out)."""

    def __init__(self, batches: MegatronBatches):
        self.batches = batches

    def __iter__(self):
        return self.batches._steps()
