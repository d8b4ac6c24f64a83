"""Which rows of a compiled step each PCP rank computes, and where each row sits in the exchange.

A step flattens its requests' new tokens (request ``r``'s ``n_r`` tokens at rows
``cu[r]..cu[r+1]-1``, :mod:`dcpgraph.runtime.step_inputs`). Each request's tokens are split over
the ``pcp`` ranks by the zigzag split (:func:`.split.rank_token_indices`), so PCP rank ``p``
computes the rows ``rows[p]`` (ascending within each request, requests in order). Every rank of a
PCP group must exchange tensors of one shape, so each list is padded to the longest, ``L``, with
row 0 (a real token: its padding copies are computed and never read). After the all-gather of
``[L, ...]`` pieces over the PCP group, global row ``i`` is at ``order[i] = p·L + j`` where
``rows[p][j] = i`` for its computing rank ``p``: ``gathered[order]`` is the step in row order.

Where a DCP group is ``1 < dcp < pcp`` PCP ranks of one TP rank (``pcp % dcp == 0``), its ranks
attend the queries of the group's rows only (:func:`pcp_group_rows`): the ``dcp·L`` rows of its
members, sorted (so each request's rows are contiguous), with their request boundaries and, per
rank, where each of its own ``L`` rows sits among them.
"""

from __future__ import annotations

import torch

from .split import rank_token_indices


def pcp_step_rows(counts: list[int], pcp: int) -> tuple[list[torch.Tensor], torch.Tensor, list[torch.Tensor]]:
    """``(rows, order, cu)``: per PCP rank the padded ``[L]`` int64 rows it computes, the ``[T]``
    int64 row of every step token in the PCP all-gather (``T = sum(counts)``), and per PCP rank the
    ``[R+1]`` int32 boundaries of each request's rows among its ``L`` (the padding counts as the
    last request's: its queries read that request's keys, bounded, and are never used)."""
    rows: list[list[int]] = [[] for _ in range(pcp)]
    bounds: list[list[int]] = [[0] for _ in range(pcp)]
    start = 0
    for n in counts:
        for p in range(pcp):
            rows[p] += [start + i for i in rank_token_indices(n, pcp, p)]
            bounds[p].append(len(rows[p]))
        start += n
    longest = max(1, max(len(r) for r in rows))
    order = [0] * start
    for p, mine in enumerate(rows):
        for j, row in enumerate(mine):
            order[row] = p * longest + j
    padded = [torch.tensor(r + [0] * (longest - len(r)), dtype=torch.int64) for r in rows]
    cu = [torch.tensor(b[:-1] + [longest], dtype=torch.int32) for b in bounds]
    return padded, torch.tensor(order, dtype=torch.int64), cu


def pcp_group_rows(rows: list[torch.Tensor], counts: list[int], dcp: int
                   ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """``(group_rows, group_cu, own)`` per PCP rank ``p``, for DCP groups of ``dcp`` consecutive PCP
    ranks: ``group_rows [dcp·L]`` int64, the padded rows of the group's ranks sorted (padding copies
    of row 0 sort first and count as request 0's queries: computed, never read); ``group_cu [R+1]``
    int32, each request's boundaries among them; ``own [L]`` int64, the position in ``group_rows``
    of each of ``rows[p]``. Every rank of a group gets the same ``group_rows`` and ``group_cu``."""
    starts = torch.tensor([0, *counts], dtype=torch.int64).cumsum(0)
    group_rows, group_cu, own = [], [], []
    for p in range(len(rows)):
        first = (p // dcp) * dcp
        members = torch.cat(rows[first:first + dcp])
        ordered, where = torch.sort(members, stable=True)
        position = torch.empty_like(where)
        position[where] = torch.arange(where.numel())
        group_rows.append(ordered)
        group_cu.append(torch.searchsorted(ordered, starts[:-1]).to(torch.int32).tolist() + [ordered.numel()])
        member = p - first
        own.append(position[member * rows[p].numel():(member + 1) * rows[p].numel()])
    return group_rows, [torch.tensor(c, dtype=torch.int32) for c in group_cu], own


def grouped_queries(mesh) -> bool:
    """Whether the DCP groups are ``1 < dcp < pcp`` PCP ranks of one TP rank, so a rank's queries
    are gathered over its group's rows only (:func:`pcp_group_rows`)."""
    return mesh.pcp > 1 and 1 < mesh.dcp < mesh.pcp and mesh.pcp % mesh.dcp == 0


def add_pcp_rows(shared: dict[str, torch.Tensor], per_rank: list[dict[str, torch.Tensor]], counts: list[int],
                 mesh) -> None:
    """Set a step's PCP inputs in place for rows of ``counts`` tokens: ``pcp_order`` in ``shared``,
    ``pcp_rows`` and ``pcp_cu_seqlens_q`` in each rank's dict (``per_rank`` in global rank order),
    and with :func:`grouped_queries` the group's ``pcp_group_rows``, ``pcp_group_cu_seqlens_q`` and
    ``pcp_own_in_group``.
    A padded graph-mode bucket calls it with the bucket's counts, so its shapes depend on the bucket
    alone: a decode bucket of ``R_b`` one-token rows is ``L = R_b`` rows on every rank (PCP rank 0
    computes them all, the others row 0 as padding)."""
    rows, shared["pcp_order"], cu = pcp_step_rows(counts, mesh.pcp)
    grouped = pcp_group_rows(rows, counts, mesh.dcp) if grouped_queries(mesh) else None
    for rank, own in zip(mesh.ranks, per_rank):
        p = mesh.pcp_rank(rank)
        own["pcp_rows"], own["pcp_cu_seqlens_q"] = rows[p], cu[p]
        if grouped is not None:
            own["pcp_group_rows"], own["pcp_group_cu_seqlens_q"], own["pcp_own_in_group"] = (g[p] for g in grouped)
