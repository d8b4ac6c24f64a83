"""Executing dcpgraph graphs: the single-process SPMD emulator and the torch.distributed runtime.

Both run the *same* GraphModule; its collectives name the logical groups of :mod:`.groups`.
"""

from .distributed import (
    RankFailedError,
    register_mesh_groups,
    run_distributed_graph,
    spawn,
    unregister_mesh_groups,
)
from .emulator import collective_name, run_spmd
from .groups import DCP_GROUP, TP_GROUP, group_kind, group_name, group_ranks

__all__ = [
    "DCP_GROUP",
    "TP_GROUP",
    "RankFailedError",
    "collective_name",
    "group_kind",
    "group_name",
    "group_ranks",
    "register_mesh_groups",
    "run_distributed_graph",
    "run_spmd",
    "spawn",
    "unregister_mesh_groups",
]
