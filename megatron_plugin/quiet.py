"""Warnings that say nothing on a run of this package, silenced only where they are raised.

Filters are added for a `with quiet(...)` block and taken out after it, so a script's own warning
settings are never changed by importing or running this package.
"""

from __future__ import annotations

import logging
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


# mcore 0.16 logs a warning for every layer whose MLP slot holds a module it does not list (our MoE layer, which
# takes its process groups from megatron-core's defaults as intended)
QUIET_BUILD_LOGS = (("megatron.core.transformer.transformer_layer", "Unknown MLP type"),)


class quiet_logs(logging.Filter):
    """`with quiet_logs(QUIET_BUILD_LOGS):` log records of those (logger, message start) pairs are dropped inside
    the block; the loggers' filters are as before after it."""

    def __init__(self, pairs):
        super().__init__()
        self.pairs = tuple(pairs)

    def filter(self, record):
        return not any(record.name == name and record.getMessage().startswith(start) for name, start in self.pairs)

    def __enter__(self):
        for name in {n for n, _ in self.pairs}:
            logging.getLogger(name).addFilter(self)
        return self

    def __exit__(self, *exc):
        for name in {n for n, _ in self.pairs}:
            logging.getLogger(name).removeFilter(self)
        return False
