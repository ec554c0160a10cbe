"""Generation with MoE layers whose expert-parallel group spans data-parallel replicas.

The MoE dispatcher gathers every token of its expert tensor x expert parallel group (`layers/moe.py`), so
the ranks of that group must run the same forwards with the same number of tokens. When the group holds
ranks of several data-parallel replicas (expert_model_parallel_size > 1), those replicas generate from
their own prompts, of their own lengths, and a row may stop at a different step on each. Here they decode
together: the group's prompts are gathered (one copy per replica), every member decodes the union with the
same decisions (sampling draws agreed over the group), and each replica keeps its own rows, shaped as if
it had decoded alone. The dense layers compute the union on every replica: generation costs the group's
replicas the union's work, which keeps their forwards in step.
"""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from ..engine.expert_group import spanning_group
from ..errors import MegatronPluginConfigError


class ExpertPeers:
    def __init__(self, group):
        self.group = group
        self.src = dist.get_global_rank(group, 0)
        self.rows: Optional[slice] = None
        self.own_width = 0
        self.lengths: Optional[torch.Tensor] = None

    @classmethod
    def of(cls, model) -> Optional["ExpertPeers"]:
        """The peers to decode with, or None when the model has no MoE layers or its expert group stays
        inside this model replica (then nothing changes). No collective."""
        group = spanning_group(model)
        return None if group is None else cls(group)

    def union(self, tokens: torch.Tensor, lengths: torch.Tensor, settings) -> tuple:
        """(tokens, lengths) of every replica of the group, right-padded to the longest; remembers this
        replica's rows. Raises on every member alike when the members asked for different settings."""
        mine = (parallel_state.get_data_parallel_rank(), tokens.cpu(), lengths.cpu(), settings)
        gathered: List = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(gathered, mine, group=self.group)
        if any(g[3] != gathered[0][3] for g in gathered):
            raise MegatronPluginConfigError(
                "megatron_generate", "different settings on data-parallel ranks of one expert-parallel group",
                "the ranks of an expert-parallel group decode together: pass them the same max_new_tokens, "
                "sampling settings and random_seed",
            )
        replicas = {}
        for dp_rank, t, n, _ in gathered:
            replicas.setdefault(dp_rank, (t, n))
        order = sorted(replicas)
        width = max(t.shape[1] for t, _ in replicas.values())
        pad = settings.pad_token
        parts, start = [], 0
        for dp_rank in order:
            t, n = replicas[dp_rank]
            if dp_rank == mine[0]:
                self.rows = slice(start, start + t.shape[0])
            parts.append(torch.nn.functional.pad(t, (0, width - t.shape[1]), value=pad))
            start += t.shape[0]
        self.own_width = int(lengths.max()) + settings.max_new_tokens
        self.lengths = lengths.cpu()
        return torch.cat(parts), torch.cat([replicas[r][1] for r in order])

    def own(self, out: torch.Tensor, stop_tokens: List[int]) -> torch.Tensor:
        """This replica's rows of the union's output, as wide as its own decoding would have made them: up to
        its longest prompt plus the new tokens, or up to where its last row stopped if all of them did (a
        union row is its prompt, its new tokens and padding, so the columns cut are padding)."""
        rows = out[self.rows]
        width = min(out.shape[1], self.own_width)
        if stop_tokens:
            lengths = self.lengths.to(rows.device)
            generated = torch.arange(rows.shape[1], device=rows.device)[None] >= lengths[:, None]
            hit = generated & torch.isin(rows, torch.tensor(stop_tokens, device=rows.device))
            if bool(hit.any(1).all()):
                width = min(width, int(hit.int().argmax(1).max()) + 1)
        return rows[:, :width]

    def agree(self, t: torch.Tensor) -> torch.Tensor:
        """Every member takes the group's first rank's decision (sampled draws differ between ranks)."""
        dist.broadcast(t, src=self.src, group=self.group)
        return t
