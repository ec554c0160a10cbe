"""Which global ranks form each Megatron group, and on which machine: the start-up layout report and the
warning for TP groups that span machines.

Pure functions of (world size, degrees, one machine name per rank), with no torch import, so the
questionnaire and `megatron-plugin launch` use them before anything starts and tests call them directly.
The rank order is megatron-core's default for `initialize_model_parallel` (order "tp-cp-ep-dp-pp": TP
fastest, then CP, DP, PP), which `tests/test_multinode_config.py` holds to megatron-core's RankGenerator.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

# fastest-varying first, as megatron-core numbers ranks (expert layers have a grid of their own: rank_groups)
ORDER = ("tp", "cp", "dp", "pp")
SHOWN_GROUPS = 8  # per kind: a 1000-GPU run's report stays a few lines


def rank_groups(world_size: int, tp: int, pp: int, cp: int = 1, ep: int = 1,
                etp: Optional[int] = None) -> Dict[str, List[List[int]]]:
    """{"tp"|"cp"|"dp"|"pp": the groups of global ranks}, in megatron-core's order of groups; with
    expert parallelism (ep > 1) also "ep": the expert-parallel groups of megatron-core's expert grid
    (expert tensor parallel `etp`, default tp, x EP x expert data parallel x PP, in the same rank order)."""
    model = tp * pp * cp
    if world_size < 1 or model < 1 or world_size % model:
        raise ValueError(f"world size {world_size} is not a multiple of tp*pp*cp={model}")
    groups = _grid({"tp": tp, "cp": cp, "dp": world_size // model, "pp": pp}, ORDER)
    if ep > 1:
        etp = etp or tp
        if world_size % (etp * ep * pp):
            raise ValueError(f"world size {world_size} is not a multiple of etp*ep*pp={etp * ep * pp}")
        experts = _grid({"tp": etp, "ep": ep, "dp": world_size // (etp * ep * pp), "pp": pp}, ("tp", "ep", "dp", "pp"))
        groups["ep"] = experts["ep"]
    return groups


def _grid(sizes: Dict[str, int], order: Sequence[str]) -> Dict[str, List[List[int]]]:
    """The groups of each kind of a grid of `sizes`, ranks numbered fastest-varying first in `order`."""
    strides, s = {}, 1
    for name in order:
        strides[name] = s
        s *= sizes[name]
    groups = {}
    for name in order:
        others = [o for o in order if o != name]
        kind = []
        # megatron-core's group index: the other coordinates as a mixed-radix number, the fastest first
        for idx in itertools.product(*(range(sizes[o]) for o in reversed(others))):
            base = sum(i * strides[o] for i, o in zip(idx, reversed(others)))
            kind.append([base + k * strides[name] for k in range(sizes[name])])
        groups[name] = kind
    return groups


def tp_spans_machines(tp: int, processes_per_machine: int) -> bool:
    """With ranks numbered machine by machine (torchrun, accelerate launch), TP groups stay on one machine
    exactly when tp divides the processes per machine."""
    return processes_per_machine % tp != 0


def tp_warning(tp: int, processes_per_machine: int, num_machines: int) -> Optional[str]:
    if num_machines <= 1 or not tp_spans_machines(tp, processes_per_machine):
        return None
    return (f"tp_degree={tp} does not divide the {processes_per_machine} processes per machine: some tensor-parallel "
            "groups span machines, and TP's all-reduces in every layer would cross the network (slow). Choose a "
            "tp_degree that divides the processes per machine, e.g. "
            f"{max(d for d in range(1, processes_per_machine + 1) if processes_per_machine % d == 0 and d <= tp)}")


def machine_names(hosts: Sequence[str], node_ranks: Sequence[Optional[int]]) -> List[str]:
    """One name per rank: the hostname, with torchrun's node rank added where two "machines" share a
    hostname (several launches on one box, as in tests)."""
    nodes_of = {}
    for h, n in zip(hosts, node_ranks):
        nodes_of.setdefault(h, set()).add(n)
    return [f"{h}#{n}" if len(nodes_of[h]) > 1 else h for h, n in zip(hosts, node_ranks)]


@dataclass
class Placement:
    groups: Dict[str, List[List[int]]]
    machines: List[str]  # per rank
    spanning: Dict[str, int] = field(default_factory=dict)  # kind -> groups on more than one machine
    warning: Optional[str] = None

    def table(self, tp: int, pp: int, cp: int) -> str:
        world = len(self.machines)
        order = list(dict.fromkeys(self.machines))
        dp = world // (tp * pp * cp)
        lines = [f"Megatron layout: {world} processes on {len(order)} machine(s); TP={tp} x CP={cp} x PP={pp} x DP={dp} "
                 "(megatron-core rank order tp-cp-dp-pp)"]
        ranks_of = {}
        for r, m in enumerate(self.machines):
            ranks_of.setdefault(m, []).append(r)
        shown = [f"{m}: {_ranges(ranks_of[m])}" for m in order[:SHOWN_GROUPS]]
        more = f" | ... {len(order) - SHOWN_GROUPS} more" if len(order) > SHOWN_GROUPS else ""
        lines.append("  machines (ranks): " + " | ".join(shown) + more)
        for kind in ("tp", "cp", "pp", "dp", "ep"):
            if kind not in self.groups:
                continue
            groups = self.groups[kind]
            if len(groups[0]) == 1:  # a degree of 1: nothing to place
                continue
            span = self.spanning[kind]
            where = "all within one machine" if span == 0 else f"{span} spanning machines"
            shown = "  ".join(self._group(g) for g in groups[:SHOWN_GROUPS])
            more = f"  ... {len(groups) - SHOWN_GROUPS} more" if len(groups) > SHOWN_GROUPS else ""
            lines.append(f"  {kind.upper()} groups ({len(groups)} of {len(groups[0])}, {where}): {shown}{more}")
        return "\n".join(lines)

    def _group(self, group: List[int]) -> str:
        by_machine = {}
        for r in group:
            by_machine.setdefault(self.machines[r], []).append(r)
        parts = [f"{_ranges(rs)}@{m}" for m, rs in by_machine.items()]
        if len(parts) > 4:
            parts = parts[:4] + [f"+{len(parts) - 4} machines"]
        return "[" + " ".join(parts) + "]"


def placement(world_size: int, tp: int, pp: int, cp: int, machines: Sequence[str], ep: int = 1,
              etp: Optional[int] = None) -> Placement:
    """The groups and where they sit. `machines`: one machine name per global rank."""
    if len(machines) != world_size:
        raise ValueError(f"{len(machines)} machine names for {world_size} ranks")
    groups = rank_groups(world_size, tp, pp, cp, ep, etp)
    spanning = {k: sum(len({machines[r] for r in g}) > 1 for g in gs) for k, gs in groups.items()}
    out = Placement(groups, list(machines), spanning)
    if spanning["tp"]:
        per_machine = Counter(machines)  # one pass: rank 0 runs this at start-up for every rank
        counts = sorted(set(per_machine.values()))
        out.warning = tp_warning(tp, counts[0], len(per_machine)) if len(counts) == 1 else None
        if out.warning is None:  # uneven machines, or ranks not numbered machine by machine
            out.warning = (f"{spanning['tp']} of {len(groups['tp'])} tensor-parallel groups span machines: TP's "
                           "all-reduces would cross the network (slow). Launch the same number of processes on "
                           "every machine, ranks numbered machine by machine (torchrun and accelerate launch do), "
                           "with a tp_degree that divides the processes per machine")
    return out


def _ranges(ranks: Sequence[int]) -> str:
    """0,1,2,3,6 -> '0-3,6'"""
    parts, start, prev = [], None, None
    for r in list(ranks) + [None]:
        if start is not None and (r is None or r != prev + 1):
            parts.append(str(start) if start == prev else f"{start}-{prev}")
            start = None
        if r is not None and start is None:
            start = r
        prev = r
    return ",".join(parts)
