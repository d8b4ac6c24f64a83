"""What a collective in a dcpgraph graph is, shared by the compiler passes and the runtimes.

- :mod:`.groups`: the logical process-group names a graph uses (``dcpgraph.tp``, ``dcpgraph.dcp``)
  and how a name resolves to ranks;
- :mod:`.registry`: one entry per ``_c10d_functional`` collective: its op, schema layout, how a pass
  emits it, its exact emulated semantics and its display name.

This package depends only on torch and :mod:`dcpgraph.mesh`, so :mod:`dcpgraph.passes`,
:mod:`dcpgraph.runtime` and :mod:`dcpgraph.explain` can all import it without importing each other.
"""

from .groups import DCP_GROUP, EP_GROUP, PCP_GROUP, TP_GROUP, group_kind, group_name, group_ranks
from .registry import (
    ALL_GATHER,
    ALL_REDUCE,
    ALL_TO_ALL,
    COLLECTIVES,
    REDUCE_OPS,
    REDUCE_SCATTER,
    WAIT,
    Collective,
    GroupMismatch,
    bind,
    collective_name,
    collective_of,
)

__all__ = [
    "ALL_GATHER",
    "ALL_REDUCE",
    "ALL_TO_ALL",
    "COLLECTIVES",
    "DCP_GROUP",
    "EP_GROUP",
    "REDUCE_OPS",
    "REDUCE_SCATTER",
    "PCP_GROUP",
    "TP_GROUP",
    "WAIT",
    "Collective",
    "GroupMismatch",
    "bind",
    "collective_name",
    "collective_of",
    "group_kind",
    "group_name",
    "group_ranks",
]
