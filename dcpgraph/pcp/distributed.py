"""A rank program (:mod:`.eager`) on real ``torch.distributed`` process groups (gloo or any backend
with ``all_gather`` and ``gather``).

``pcp_all_gather``/``dcp_all_gather`` exchange the row counts first (one int per rank), pad every
payload to the largest and trim after, since ranks hold different numbers of tokens;
``dcp_all_to_all`` is one ``gather`` per destination (every sender's entry for one destination has
that destination's shape), as gloo has no all-to-all; ``tp_all_reduce`` is ``all_reduce``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..errors import CollectiveMismatchError
from ..mesh import Mesh
from .eager import RankProgram


@dataclass(frozen=True)
class RankGroups:
    """This rank's PCP, DCP and TP process groups and their global ranks."""

    pcp: Any
    pcp_ranks: tuple[int, ...]
    dcp: Any
    dcp_ranks: tuple[int, ...]
    tp: Any = None
    tp_ranks: tuple[int, ...] = ()


def new_rank_groups(mesh: Mesh, rank: int) -> RankGroups:
    """Create every PCP, DCP and TP group of ``mesh`` (a collective call: every rank makes them
    all, in one order) and return ``rank``'s."""
    made = {}
    for kind in ("pcp", "dcp", "tp"):
        for g in sorted({mesh.group(kind, r) for r in mesh.ranks}):
            made[(kind, g)] = dist.new_group(list(g))
    pcp, dcp, tp = mesh.pcp_group(rank), mesh.dcp_group(rank), mesh.tp_group(rank)
    return RankGroups(made[("pcp", pcp)], pcp, made[("dcp", dcp)], dcp, made[("tp", tp)], tp)


def run_distributed(program: RankProgram, groups: RankGroups) -> Any:
    """Drive ``program`` to completion on ``groups``; its return value."""
    try:
        op, payload = next(program)
        while True:
            op, payload = program.send(_collective(op, payload, groups))
    except StopIteration as stop:
        return stop.value


def _collective(op: str, payload: Any, groups: RankGroups) -> Any:
    if op == "pcp_all_gather":
        return all_gather_rows(payload, groups.pcp, len(groups.pcp_ranks))
    if op == "dcp_all_gather":
        return all_gather_rows(payload, groups.dcp, len(groups.dcp_ranks))
    if op == "dcp_all_to_all":
        return _all_to_all(payload, groups)
    if op == "tp_all_reduce":
        total = payload.clone()
        dist.all_reduce(total, group=groups.tp)
        return total
    raise CollectiveMismatchError(f"unknown collective {op!r}")


def all_gather_rows(tensor: torch.Tensor, group: Any, size: int) -> list[torch.Tensor]:
    """Every group member's ``tensor`` (equal but for the first dimension), in group-rank order."""
    rows = torch.tensor([tensor.shape[0]], dtype=torch.long)
    counts = [torch.zeros_like(rows) for _ in range(size)]
    dist.all_gather(counts, rows, group=group)
    longest = int(max(c.item() for c in counts))
    padded = tensor.new_zeros((longest, *tensor.shape[1:]))
    padded[: tensor.shape[0]] = tensor
    out = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(out, padded.contiguous(), group=group)
    return [o[: int(c.item())] for o, c in zip(out, counts)]


def _all_to_all(entries: list[torch.Tensor], groups: RankGroups) -> list[torch.Tensor]:
    me = dist.get_rank()
    received: list[torch.Tensor] = []
    for j, dst in enumerate(groups.dcp_ranks):
        sent = entries[j].contiguous()
        bucket = [torch.empty_like(sent) for _ in groups.dcp_ranks] if dst == me else None
        dist.gather(sent, bucket, dst=dst, group=groups.dcp)
        if dst == me:
            received = bucket
    return received
