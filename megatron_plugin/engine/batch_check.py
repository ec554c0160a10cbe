"""The batch check: a batch the model cannot take is refused on every rank alike, before any update.

`BatchCheck.check` computes a few flags on the device (ids or labels outside the vocabulary, a sequence
longer than the model's positions, the loss tokens, the train step's own verdict), sums them over all
ranks in one small all-reduce (so no rank is left waiting in a collective) and reads them back once.

The same all-reduce tells whether the ranks of each model replica (its tensor-, context- and
pipeline-parallel ranks) were given the same batch, as they must be: each rank writes a checksum of its
batch's integer tensors (`batch_checksum`: ids, labels, masks, positions) into its own slot of a vector of
one slot per rank of a replica, zeros elsewhere. Summed over the world, every slot holds the sum over the
data-parallel replicas (which legitimately differ) of that position's checksum: all slots are equal when
each replica's ranks agree, and differ (but for a 2^-31 chance) when some do not. Megatron-LM and
accelerate broadcast the batch from TP rank 0 instead; this costs no extra collective.

The flags can be read without stalling the GPU. Reading a device value back (`tolist()`) waits for everything queued before it: at the start of a step
that is the whole previous optimizer step, after which the GPU idles while the host launches the new
forward (2-3 ms a step on an H100 at GPT-2 350M and 774M, measured with `.devrun`-style probes). So the
CUDA engine copies the flags to pinned host memory behind the previous step's work, queues the first
micro-batch's forward on a batch made safe to run (ids out of range replaced), and only then waits for
the copy, while the GPU computes. A bad batch still raises before any backward or optimizer update.
"""

from __future__ import annotations

import functools
import math
import warnings
import zlib
from dataclasses import dataclass
from itertools import islice
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from ..errors import MegatronPluginConfigError
from ..layers.masks import KNOWN, rows_not_packed, rows_without_padding


CHECKSUM_PRIME = 2**31 - 1  # a rank's checksum is below it, so int64 sums over any world stay exact


@functools.lru_cache(maxsize=4)
def _checksum_weights(n: int, device: torch.device) -> torch.Tensor:
    """n pseudo-random weights in [1, P) from the position alone: multiplications modulo P and xor-shifts
    (no product reaches 2^63), so that reordered or shifted values change the sum."""
    w = torch.arange(1, n + 1, dtype=torch.int64, device=device) % CHECKSUM_PRIME
    for mul, shift in ((48271, 13), (69621, 17), (16807, 11)):
        w = w * mul % CHECKSUM_PRIME
        w = w ^ (w >> shift)
    return w % (CHECKSUM_PRIME - 1) + 1


def batch_checksum(batch: Dict[str, object]) -> torch.Tensor:
    """A 0-d int64 tensor in [0, 2^31 - 1): a checksum of the batch's integer (and bool) tensors, their
    values, positions, keys and shapes, in exact int64 arithmetic modulo a prime. Computed on the tensors'
    device without reading it back."""
    keys = [k for k in sorted(batch) if torch.is_tensor(batch[k])
            and not (batch[k].is_floating_point() or batch[k].is_complex())]
    if not keys:
        return torch.zeros((), dtype=torch.int64)
    device = batch[keys[0]].device
    flat = torch.cat([batch[k].reshape(-1).to(device, torch.int64) for k in keys]) % CHECKSUM_PRIME
    layout = zlib.crc32(repr([(k, tuple(batch[k].shape)) for k in keys]).encode()) % CHECKSUM_PRIME
    return ((flat * _checksum_weights(flat.numel(), device)) % CHECKSUM_PRIME).sum().add_(layout) % CHECKSUM_PRIME


def replica_layout() -> Tuple[int, int, int]:
    """(tensor, context, pipeline)-parallel sizes: the ranks of one model replica, which need one batch."""
    return (parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_context_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size())


def replica_position(slot: int, layout: Tuple[int, int, int]) -> str:
    """A rank's place in its model replica, e.g. 'tp rank 1' or 'tp rank 0, pp stage 1'."""
    tp, cp, pp = layout
    parts = [("tp rank", slot % tp, tp), ("cp rank", slot // tp % cp, cp), ("pp stage", slot // (tp * cp), pp)]
    return ", ".join(f"{name} {i}" for name, i, size in parts if size > 1)


def _tell_shard(micro_batch: Dict[str, torch.Tensor], key: str, fact: bool) -> None:
    """Under context parallelism the keys' mask is built from the WHOLE attention mask / position ids the
    sequence shard carries (layers/context_parallel.SequenceShard): they get the fact too, so that building
    the mask reads nothing from the device. A whole row without padding (or packing) has none in any part."""
    from ..layers.context_parallel import shard_of

    if key not in ("attention_mask", "position_ids"):
        return
    for value in micro_batch.values():
        shard = shard_of(value) if torch.is_tensor(value) else None
        whole = getattr(shard, key, None)
        if torch.is_tensor(whole):
            setattr(whole, KNOWN, fact)


class NoLossInStep(Exception):
    """No token of the whole step carries a loss: the engine skips the step (raised inside the schedule,
    before any backward)."""


class DeferredCheck:
    def __init__(self, flags: torch.Tensor, verdict: Callable[[list], bool], safe_batch: Dict[str, torch.Tensor]):
        self.safe_batch = safe_batch
        self._verdict = verdict
        self._ok = None
        if flags.is_cuda:
            self._host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
            self._host.copy_(flags, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host, self._ready = flags, None

    def resolve(self) -> bool:
        """Wait for the flags (not for the work queued after them) and judge them once: raises for a bad
        batch, returns False when no token carries a loss."""
        if self._ok is None:
            if self._ready is not None:
                self._ready.synchronize()
            self._ok = False  # judged, even if the verdict raises
            self._ok = self._verdict(self._host.tolist())
        return self._ok

    def raise_if_no_loss(self) -> None:
        if not self.resolve():
            raise NoLossInStep()


class Flags(NamedTuple):
    """The check's numbers for one batch: this rank's own, or summed over all ranks by the all-reduce."""

    bad_ids: int  # some input ids lie outside the vocabulary
    bad_labels: int  # some labels lie outside it, other than -100
    too_long: int  # a sequence is longer than the model's positions
    loss_tokens: int  # tokens that carry a loss (1 when no loss is asked for)
    step_rejected: int  # the train step's check_shapes or check_batch refused the batch


@dataclass
class Findings:
    """What the host knows of one batch while its flags are on their way: enough to name what is wrong
    once they arrive, and the micro-batches whose mask / position facts travel with them."""

    batch: Dict[str, torch.Tensor]
    id_keys: List[str]
    label_keys: List[str]
    out_of_range: Dict[str, torch.Tensor]
    vocab: int
    limit: Optional[int]
    length: int
    iteration: int
    error: Optional[Exception] = None
    layout: Tuple[int, int, int] = (1, 1, 1)  # the model replica's (tp, cp, pp): one checksum slot per rank
    sequence_parallel: bool = False  # the model splits each rank's sequence over its TP ranks
    fact_keys: Sequence[str] = ()
    micro_batches: Sequence[Dict[str, torch.Tensor]] = ()

    @property
    def too_long(self) -> bool:
        return self.limit is not None and self.length > self.limit

    @property
    def slots(self) -> int:
        """Checksum slots: one per rank of a model replica, none when a replica is one rank."""
        tp, cp, pp = self.layout
        return 0 if tp * cp * pp == 1 else tp * cp * pp

    def judge(self, values: list) -> bool:
        """Read the flags (all ranks' with the replica's checksums, then this rank's, then the
        per-micro-batch facts, in the order `BatchCheck.check` laid them out): raise for a bad batch,
        False when no token carries a loss."""
        read = iter(values)
        everyone = Flags(*islice(read, len(Flags._fields)))
        self.check_one_batch_per_replica(list(islice(read, self.slots)))
        mine = Flags(*islice(read, len(Flags._fields)))
        ok = self.verdict(everyone, mine)
        for k in self.fact_keys:
            for mb in self.micro_batches:
                fact = bool(next(read))
                setattr(mb[k], KNOWN, fact)
                if self.layout[1] > 1:
                    _tell_shard(mb, k, fact)
        return ok

    def check_one_batch_per_replica(self, sums: List[int]) -> None:
        """Raise when the summed checksums differ between the slots: some replica's ranks had different batches."""
        differ = [i for i, s in enumerate(sums) if s != sums[0]]
        if not differ:
            return
        kinds = "/".join(k for k, size in zip(("tensor", "context", "pipeline"), self.layout) if size > 1)
        raise MegatronPluginConfigError(
            "batch", f"{kinds}-parallel ranks were given different batches ({replica_position(differ[0], self.layout)}"
            f" got another batch than {replica_position(0, self.layout)}): they would train on a mixture of both",
            "pass the same batch on every rank of a model replica: iterate the DataLoader accelerator.prepare "
            "returns (it gives each data-parallel rank its part, and the same to the ranks of its replica), and "
            "seed any per-rank generation of batches alike (not by rank)",
        )

    def verdict(self, everyone: Flags, mine: Flags) -> bool:
        """What the flags mean: raise for a bad batch, False for no loss."""
        here = (" (this rank's batch)" if mine.bad_ids or mine.bad_labels or mine.too_long or mine.step_rejected
                else " (another rank's batch)")
        vocab, limit = self.vocab, self.limit
        if everyone.step_rejected:
            if self.error is not None:
                raise self.error
            raise MegatronPluginConfigError("batch", "rejected by the train step" + here, "see the error on that rank")
        if everyone.bad_ids:
            bad = self._bad_keys(self.id_keys) if mine.bad_ids else []
            k = bad[0] if bad else "input_ids"
            span = f": min {int(self.batch[k].min())}, max {int(self.batch[k].max())}" if bad else ""
            raise MegatronPluginConfigError(
                k, f"ids outside [0, {vocab}){here}" + span,
                f"the model's vocabulary has {vocab} entries: use its tokenizer (or resize_token_embeddings before prepare)",
            )
        if everyone.bad_labels:
            bad = self._bad_keys(self.label_keys) if mine.bad_labels else []
            raise MegatronPluginConfigError(
                bad[0] if bad else "labels", f"ids outside [0, {vocab}) other than -100{here}",
                "labels are token ids of the model's vocabulary, or -100 for positions without loss",
            )
        if everyone.too_long:
            raise MegatronPluginConfigError(
                "sequence length", f"{self.length} > {limit}{here}" if mine.too_long else f"> {limit}{here}",
                f"the model has {limit} positions: cut the sequences (block_size / max_length) to at most {limit}",
            )
        if everyone.loss_tokens == 0:
            warnings.warn(
                f"step {self.iteration}: every label of the batch is -100 (ignored), so there is no loss: the "
                "step is skipped and reports loss nan. Check the collator (e.g. prompts longer than max_length)."
            )
            return False
        return True

    def _bad_keys(self, keys) -> List[str]:
        return [k for k in keys if self.out_of_range[k].any()]

    def safe_batch(self, device) -> Dict[str, torch.Tensor]:
        """The batch with out-of-range ids and labels replaced, so that a forward queued before the flags
        are read stays in bounds (an out-of-range id would fault the embedding)."""
        safe = dict(self.batch)
        for k in self.id_keys + self.label_keys:
            fill = -100 if k in self.label_keys else 0
            safe[k] = self.batch[k].to(device).masked_fill(self.out_of_range[k].to(device), fill)
        return safe


def sequence_multiple(layout: Tuple[int, int, int], sequence_parallel: bool) -> int:
    """What every sequence length must be a multiple of: 2 x CP (the load-balanced chunks of context
    parallelism), times what sequence parallelism adds (it splits each rank's 2 x L tokens over TP)."""
    tp, cp, _ = layout
    chunks = 2 * cp if cp > 1 else 1
    split = cp * tp if sequence_parallel and tp > 1 else 1
    return chunks * split // math.gcd(chunks, split)


def split_lengths(found: Findings) -> List[Tuple[str, int]]:
    """(name, length) of each sequence the model runs on. Under context parallelism that is what the engine
    splits: each micro-batch's `input_ids` after the train step's `before_sequence_split` (DPO's chosen and
    rejected rows joined, padded to the longer), whole whether or not it was split yet; else every ids key."""
    from ..layers.context_parallel import shard_of

    if found.layout[1] > 1 and found.micro_batches and all("input_ids" in mb for mb in found.micro_batches):
        name = "input_ids" if "input_ids" in found.batch else " and ".join(found.id_keys) + " (joined)"
        lengths = []
        for mb in found.micro_batches:
            shard = shard_of(mb["input_ids"])
            lengths.append((name, shard.seq_len if shard is not None else mb["input_ids"].shape[-1]))
        return lengths
    return [(k, found.batch[k].shape[-1]) for k in found.id_keys]


def context_parallel_error(found: Findings) -> Optional[MegatronPluginConfigError]:
    """Under context parallelism each sequence is cut into 2 x CP equal chunks (layers/context_parallel.py):
    a length that 2 x CP does not divide is refused (on every rank, through the check's all-reduce) before
    any forward. The engine does not pad it: padded positions would change what the model returns."""
    cp = found.layout[1]
    if cp == 1:
        return None
    for k, length in split_lengths(found):
        if length % (2 * cp):
            m = sequence_multiple(found.layout, found.sequence_parallel)
            return MegatronPluginConfigError(
                "context_parallel_size", cp,
                f"the sequence length {length} of {k!r} must be a multiple of 2 x context_parallel_size = {2 * cp} "
                f"(each sequence is cut into {2 * cp} equal chunks): pad sequences to a multiple of {m}, e.g. "
                f"pad_to_multiple_of={m} in the collator (DataCollatorForLanguageModeling, DataCollatorForSeq2Seq) "
                "or the tokenizer, with the padding's labels -100; or use context_parallel_size=1",
            )
    return None


def sequence_parallel_error(found: Findings, plugin) -> Optional[MegatronPluginConfigError]:
    """Under sequence parallelism megatron-core splits the sequence evenly over the TP ranks: a length that
    tp_degree does not divide is refused (on every rank, through the check's all-reduce), before the step.
    Under context parallelism that is each rank's part of the sequence, length / context_parallel_size."""
    tp, cp, _ = found.layout
    if tp == 1 or not getattr(plugin, "sequence_parallelism", False):
        return None
    m = sequence_multiple(found.layout, True)
    for k, length in split_lengths(found):
        if length % m:
            across = f"tp_degree={tp}" if cp == 1 else (
                f"tp_degree x context_parallel_size = {tp * cp} (and of 2 x context_parallel_size = {2 * cp})")
            return MegatronPluginConfigError(
                "sequence_parallelism", True,
                f"the sequence length {length} of {k!r} must be a multiple of {across}: pad the batches to a "
                f"multiple of {m} (e.g. the tokenizer's pad_to_multiple_of={m}), or set sequence_parallelism=False",
            )
    return None


class BatchCheck:
    """Refuses token ids or labels the model cannot have, a sequence longer than its positions, different
    batches on the ranks of one model replica, or a batch the train step rejects, on every rank alike,
    with one all-reduce and one read."""

    def __init__(self, model, device: torch.device):
        self.model = model
        self.device = device

    def check(self, batch, step, micro_batches=(), *, iteration: int, need_loss: bool = True, defer: bool = False):
        """Returns False when no token of the whole step carries a loss, else True (`iteration` names the
        step in the warning). The flags are computed on the device and read back once. That read waits for
        the GPU to drain its queue, so with `defer` it is not made here: the flags travel to the host behind
        the previous step's work, and a `DeferredCheck` is returned, read once the first micro-batch's
        forward is queued (`safe_batch` keeps that forward in bounds whatever the batch holds).

        The same read tells, per micro-batch, whether its attention masks pad anything and whether its
        position ids pack sequences; those answers are set on `micro_batches`' tensors (layers/masks.py),
        so the train step need not read the device for them once per micro-batch. The forward needs
        them before it is queued, so a batch with such keys is read here, even with `defer`."""
        found = self._look(batch, step, iteration)
        found.micro_batches = micro_batches  # under CP their lengths are the ones split (split_lengths)
        local = self._flags(found, step, need_loss)
        status = torch.cat([local, self._replica_checksums(found)])
        if dist.get_world_size() > 1:
            dist.all_reduce(status)
        found.fact_keys = [k for k, v in batch.items() if torch.is_tensor(v) and v.dim() == 2 and micro_batches
                           and (k.endswith("attention_mask") or k == "position_ids")]
        values = torch.cat([status, local, *self._facts(found)])
        # a batch known bad on the host says so now (after the all-reduce, so every rank does)
        if not defer or found.error is not None or found.too_long or found.fact_keys:
            return found.judge(values.tolist())
        return DeferredCheck(values, found.judge, found.safe_batch(self.device))

    def _look(self, batch, step, iteration: int) -> Findings:
        """What the host can tell without reading the device: which keys to check, the longest sequence."""
        cfg = self.model.hf_config
        vocab = cfg.vocab_size
        id_keys = sorted({k for k, v in batch.items() if k.endswith("input_ids") and torch.is_tensor(v)} | {step.input_key})
        label_keys = [k for k, v in batch.items() if k.endswith("labels") and torch.is_tensor(v)]
        out_of_range = {k: (batch[k] < 0) | (batch[k] >= vocab) for k in id_keys}
        out_of_range.update({k: ((batch[k] < 0) & (batch[k] != -100)) | (batch[k] >= vocab) for k in label_keys})
        length = max(batch[k].shape[1] for k in id_keys if batch[k].dim() == 2)
        return Findings(batch, id_keys, label_keys, out_of_range, vocab, self.model.family.position_limit(cfg),
                        length, iteration, layout=replica_layout(),
                        sequence_parallel=bool(getattr(self.model.plugin, "sequence_parallelism", False)))

    def _replica_checksums(self, found: Findings) -> torch.Tensor:
        """This rank's batch checksum in its slot of the model replica, zeros in the others (summed over
        the world by the check's all-reduce)."""
        sums = torch.zeros(found.slots, dtype=torch.int64, device=self.device)
        if found.slots:
            tp, cp, _ = found.layout
            slot = parallel_state.get_tensor_model_parallel_rank() + tp * (
                parallel_state.get_context_parallel_rank() + cp * parallel_state.get_pipeline_model_parallel_rank())
            sums[slot] = batch_checksum(found.batch).to(self.device)
        return sums

    def _flags(self, found: Findings, step, need_loss: bool) -> torch.Tensor:
        """This rank's `Flags`, as one device tensor; a train step that rejects the batch is noted in
        `found.error`, to be raised once every rank knows."""

        def const(value):  # a fill kernel: writing a host number into a device tensor would sync
            return torch.full((), int(value), dtype=torch.int64, device=self.device)

        def any_of(keys):
            hits = [found.out_of_range[k].any().to(self.device) for k in keys]  # an empty tensor has none
            return torch.stack(hits).any().long() if hits else const(0)

        bad_ids, bad_labels, too_long = any_of(found.id_keys), any_of(found.label_keys), const(found.too_long)
        tokens = step.count_loss_tokens(found.batch) if need_loss else None
        loss_tokens = const(1) if tokens is None else tokens.to(self.device, torch.int64).reshape(())
        try:  # the shapes the step pairs, the sequence split, then (for a loss) the step's own check
            found.error = (step.check_shapes(found.batch) or context_parallel_error(found)
                           or sequence_parallel_error(found, self.model.plugin)
                           or (step.check_batch(found.batch) if need_loss else None))
        except Exception as e:  # raised by the verdict, once every rank knows
            found.error = e
        flags = Flags(bad_ids, bad_labels, too_long, loss_tokens, const(found.error is not None))
        return torch.stack(list(flags))

    def _facts(self, found: Findings) -> List[torch.Tensor]:
        """Per micro-batch: no padding in each attention mask, no packed sequences in the position ids."""
        n = len(found.micro_batches)
        return [(rows_without_padding if k.endswith("attention_mask") else rows_not_packed)(found.batch[k])
                .reshape(n, -1).all(1).to(self.device, torch.int64) for k in found.fact_keys]
