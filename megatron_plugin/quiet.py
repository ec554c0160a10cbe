"""Warnings that say nothing on a run of this package, silenced only where they are raised.

Filters are added for a `with quiet(...)` block and taken out after it, so a script's own warning
settings are never changed by importing or running this package.
"""

from __future__ import annotations

import warnings
from typing import Iterable

# TE and apex are optional here; megatron-core warns at import that they are absent
QUIET_IMPORT = (".*Transformer Engine and Apex are not installed.*", ".*Apex is not installed.*")
# mcore 0.16 warns about its own default cuda_graph_scope on every TransformerConfig
QUIET_CONFIG = (".*full scope is deprecated.*",)


class quiet:
    """`with quiet(patterns):` those warnings are not shown inside the block. Only the filters it added are
    removed after it: filters that code run inside the block adds (a library's own, at its import) stay."""

    def __init__(self, patterns: Iterable[str]):
        self.patterns = tuple(patterns)
        self._added = []

    def __enter__(self):
        for pattern in self.patterns:
            warnings.filterwarnings("ignore", message=pattern)
            self._added.append(warnings.filters[0])
        return self

    def __exit__(self, *exc):
        for entry in self._added:
            if entry in warnings.filters:
                warnings.filters.remove(entry)
        self._added = []
        warnings._filters_mutated()
        return False
