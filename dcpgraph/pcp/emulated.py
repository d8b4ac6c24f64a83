"""Every rank's program (:mod:`.eager`) in this process, in lockstep, with exact collectives.

All ranks must issue the same collective at the same step (as on real process groups); a
mismatch raises :class:`~dcpgraph.errors.CollectiveMismatchError` naming the ranks and ops.
"""

from __future__ import annotations

from typing import Any

from ..errors import CollectiveMismatchError
from ..mesh import Mesh
from .eager import RankProgram


def run_emulated(mesh: Mesh, programs: dict[int, RankProgram]) -> dict[int, Any]:
    """Drive ``programs`` (rank → generator) to completion; rank → its return value."""
    pending: dict[int, tuple[str, Any]] = {}
    results: dict[int, Any] = {}
    for rank, program in programs.items():
        _advance(rank, program, None, pending, results, first=True)
    while pending:
        ops = {op for op, _ in pending.values()}
        if len(ops) != 1 or set(pending) | set(results) != set(programs) or results:
            raise CollectiveMismatchError(f"ranks disagree: pending {({r: op for r, (op, _) in pending.items()})}, "
                                          f"finished {sorted(results)}")
        op = ops.pop()
        replies = {rank: _collective(mesh, op, rank, pending) for rank in pending}
        current, pending = pending, {}
        for rank in current:
            _advance(rank, programs[rank], replies[rank], pending, results)
    return results


def _advance(rank, program, reply, pending, results, first=False) -> None:
    try:
        pending[rank] = next(program) if first else program.send(reply)
    except StopIteration as stop:
        results[rank] = stop.value


def _collective(mesh: Mesh, op: str, rank: int, pending: dict[int, tuple[str, Any]]) -> Any:
    if op == "pcp_all_gather":
        return [pending[r][1] for r in mesh.pcp_group(rank)]
    if op == "dcp_all_gather":
        return [pending[r][1] for r in mesh.dcp_group(rank)]
    if op == "tp_all_reduce":
        parts = [pending[r][1] for r in mesh.tp_group(rank)]
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        return total
    if op == "dcp_all_to_all":
        me = mesh.dcp_rank(rank)
        return [pending[r][1][me] for r in mesh.dcp_group(rank)]
    raise CollectiveMismatchError(f"unknown collective {op!r} from rank {rank}")
