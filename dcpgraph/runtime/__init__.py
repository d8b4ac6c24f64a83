"""Executing dcpgraph graphs: the single-process SPMD emulator and the torch.distributed runtime.

Both run the *same* GraphModule; its collectives name the logical groups of
:mod:`dcpgraph.collectives.groups` and mean what :mod:`dcpgraph.collectives.registry` says.
"""

from .distributed import (
    RankFailedError,
    register_mesh_groups,
    run_distributed_graph,
    spawn,
    unregister_mesh_groups,
)
from .emulator import run_spmd

__all__ = [
    "RankFailedError",
    "register_mesh_groups",
    "run_distributed_graph",
    "run_spmd",
    "spawn",
    "unregister_mesh_groups",
]
