"""Warnings that say nothing on a run of this package, silenced only where they are raised.

Filters are added inside a `with quiet(...)` block and the process-wide filters are as they were after
it, so a script's own warning settings are never changed by importing or running this package.
"""

from __future__ import annotations

import warnings
from typing import Iterable

# TE and apex are optional here; megatron-core warns at import that they are absent
QUIET_IMPORT = (".*Transformer Engine and Apex are not installed.*", ".*Apex is not installed.*")
# mcore 0.16 warns about its own default cuda_graph_scope on every TransformerConfig
QUIET_CONFIG = (".*full scope is deprecated.*",)


class quiet:
    """`with quiet(patterns):` those warnings are not shown inside the block, and the process-wide
    filters are as they were after it."""

    def __init__(self, patterns: Iterable[str]):
        self.patterns = tuple(patterns)
        self._ctx = warnings.catch_warnings()

    def __enter__(self):
        self._ctx.__enter__()
        for pattern in self.patterns:
            warnings.filterwarnings("ignore", message=pattern)
        return self

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)


