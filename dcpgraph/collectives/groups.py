"""Logical process-group names used by every collective in a dcpgraph graph.

A dcpgraph program is SPMD: the *same* FX graph runs on every rank, so a collective node cannot name
a concrete process group (which differs from rank to rank for the DCP groups). Instead the
``group_name`` argument of ``torch.ops._c10d_functional.*`` is one of two logical names:

- ``TP_GROUP = "dcpgraph.tp"``: the tensor-parallel group, which is the whole world;
- ``DCP_GROUP = "dcpgraph.dcp"``: the DCP group *of the calling rank* (``mesh.dcp_group(rank)``);
- ``PCP_GROUP = "dcpgraph.pcp"``: the PCP group of the calling rank (``mesh.pcp_group(rank)``, the
  ``pcp`` ranks with its TP rank), over which a prefill's tokens are split;
- ``EP_GROUP = "dcpgraph.ep"``: the expert-parallel group of data-parallel replicas, every rank of
  every replica (:class:`~dcpgraph.mesh.ReplicaMesh`; a single replica's EP group is its world).

How a name becomes a group of ranks, in the two execution modes:

- **Emulator** (:func:`dcpgraph.runtime.emulator.run_spmd`): all ranks run in one process and the
  name together with the rank resolves through the mesh: :func:`group_ranks`.
- **torch.distributed** (:mod:`dcpgraph.runtime.distributed`): functional collectives resolve a
  group name with ``torch._C._distributed_c10d._resolve_process_group(name)``, a per-process
  registry. Each process registers the world under ``TP_GROUP`` and *its own* DCP subgroup under
  ``DCP_GROUP`` with ``_register_process_group``, so the identical graph reaches the right
  communicator on every rank (checked against torch 2.13: registering a second process group under
  an existing name raises, so re-registration unregisters first; destroying the world process
  group clears the whole registry).

Invariant: both names are distinct communicators even when they hold the same ranks (``dcp == tp``
or ``dcp == 1`` with ``tp == 1``); a rank in a TP collective never matches a rank in a DCP one.
"""

from __future__ import annotations

from ..mesh import Mesh

__all__ = ["DCP_GROUP", "EP_GROUP", "PCP_GROUP", "TP_GROUP", "group_kind", "group_name", "group_ranks"]

TP_GROUP = "dcpgraph.tp"
DCP_GROUP = "dcpgraph.dcp"
EP_GROUP = "dcpgraph.ep"
PCP_GROUP = "dcpgraph.pcp"

_KIND_OF_NAME = {TP_GROUP: "tp", DCP_GROUP: "dcp", EP_GROUP: "ep", PCP_GROUP: "pcp"}
_NAME_OF_KIND = {kind: name for name, kind in _KIND_OF_NAME.items()}


def group_kind(group_name: object) -> str:
    """``"tp"``, ``"dcp"``, ``"pcp"`` or ``"ep"`` for a logical group name; ``ValueError`` for anything else."""
    kind = _KIND_OF_NAME.get(group_name) if isinstance(group_name, str) else None
    if kind is None:
        raise ValueError(
            f"unknown process-group name {group_name!r}: dcpgraph graphs must use the logical "
            f"names {TP_GROUP!r} (the TP group, i.e. the world), {DCP_GROUP!r} (the caller's "
            f"DCP group), {PCP_GROUP!r} (the caller's PCP group) or {EP_GROUP!r} (every rank of the data-parallel replicas)"
        )
    return kind


def group_name(kind: str) -> str:
    """The logical name of group kind ``"tp"``, ``"dcp"``, ``"pcp"`` or ``"ep"`` (inverse of :func:`group_kind`)."""
    try:
        return _NAME_OF_KIND[kind]
    except KeyError:
        raise ValueError(f"unknown group kind {kind!r}; expected 'tp', 'dcp', 'pcp' or 'ep'") from None


def group_ranks(mesh: Mesh, name: object, rank: int) -> tuple[int, ...]:
    """Global ranks, in group-rank order, of the group that ``name`` denotes on ``rank``."""
    return mesh.group(group_kind(name), rank)
