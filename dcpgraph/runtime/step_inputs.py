"""Per-step, per-rank inputs of a compiled program: the flattened token layout
(docs/architecture.md, Runtime: the token layout).

Every scheduled token of every request is flattened into one sequence. For request ``r`` with
``context_lens[r]`` tokens already cached and ``n_r`` new tokens this step:

- ``input_ids``/``position_ids`` ``[1, T]``: the new tokens at positions ``context + arange(n_r)``;
- ``cu_seqlens_q`` ``[R+1]``: request boundaries in the flattened sequence;
- ``context_lens`` ``[R]`` (global) and ``local_context_lens`` ``[R]``: ``layout.local_len`` for
  this rank's DCP index;
- ``block_table`` ``[R, W]``: the shared virtual-block table (padding entries are never read);
- ``slot_mapping`` ``[T]``: where this rank writes each new token, −1 where it does not own it;
- ``logits_indices``: the last ``logits_rows`` new tokens of each request (one, or ``1 + k`` when
  ``k`` draft tokens are verified);
- ``tp_rank`` / ``dcp_rank``: this rank's index in its groups (data, not control flow);
- with ``hybrid_kv_cache``: ``block_table_sliding`` and ``slot_mapping_sliding``, the same for
  the sliding layers' own table (see :mod:`.layer_groups`);
- for a model with recurrent layers: ``state_slots`` ``[R]``, each request's state slot;
- with ``pcp > 1``: ``pcp_order`` ``[T]`` (shared) and per rank ``pcp_rows`` ``[L]`` and
  ``pcp_cu_seqlens_q`` ``[R+1]``: the rows this rank computes, where each row sits in the PCP
  exchange, and its rows' request boundaries; with ``1 < dcp < pcp`` also its DCP group's rows
  (``pcp_group_rows``, ``pcp_group_cu_seqlens_q``, ``pcp_own_in_group``) (:mod:`dcpgraph.pcp.step_rows`).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import torch

from .. import layout
from ..mesh import Mesh
from ..pcp.step_rows import add_pcp_rows

# Steps of at most this many tokens compute slots and lengths on Python ints; longer ones on tensors.
SMALL_STEP_TOKENS = 256


@dataclass(frozen=True)
class Chunk:
    """``tokens`` of one request, starting at global position ``start``."""

    request_id: int
    tokens: tuple[int, ...]
    start: int
    block_table: tuple[int, ...]
    logits_rows: int = 1
    sliding_table: tuple[int, ...] | None = None  # the sliding layers' table (hybrid_kv_cache)
    state_slot: int | None = None  # the request's recurrent-state slot (hybrid models)


class TableRows:
    """Block-table rows as int32 tensors, kept per request from one step to the next.

    The row object of the last step (the block manager hands out the same tuple until the table
    changes, :meth:`BlockManager.frozen_table`) is that step's tensor, with no pass over it; a
    row equal to it is too; a row that only grew is it plus the new entries. Any other row (a
    sliding table whose oldest block was just nulled, :mod:`.layer_groups`) is converted whole,
    through an ``array`` (~13 ns an entry, against ~45 for ``torch.tensor`` of a tuple; a 128K
    context's row at 16-token blocks has 8K). Rows of requests absent from a step are dropped.
    The tensors are shared between steps: read them only."""

    def __init__(self) -> None:
        self._rows: dict[tuple[str, int], tuple[tuple[int, ...], torch.Tensor]] = {}

    def tables(self, kind: str, rows: list[tuple[int, tuple[int, ...]]]) -> list[torch.Tensor]:
        """The tensors of ``(request id, row)`` pairs of table ``kind``; forgets other requests'."""
        kept, out = {}, []
        for request_id, row in rows:
            key = (kind, request_id)
            last = self._rows.get(key)
            if last is not None and (last[0] is row or last[0] == row):
                tensor = last[1]
            elif last is not None and len(row) > len(last[0]) and row[: len(last[0])] == last[0]:
                tensor = torch.cat([last[1], int32_row(row[len(last[0]):])])
            else:
                tensor = int32_row(row)
            kept[key] = (row, tensor)
            out.append(tensor)
        self._rows = {k: v for k, v in self._rows.items() if k[0] != kind} | kept
        return out


def int32_row(row: tuple[int, ...]) -> torch.Tensor:
    """``row`` as a 1-D int32 tensor; raises ``OverflowError`` for an entry outside int32."""
    return torch.frombuffer(array("i", row), dtype=torch.int32) if row else torch.zeros(0, dtype=torch.int32)


def build_step_inputs(
    chunks: list[Chunk], mesh: Mesh, block_size: int, interleave: int, rows: TableRows | None = None
) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    """Inputs shared by all ranks, and each rank's own ``slot_mapping``/lengths/ranks.

    The index lists are built in Python and become one tensor each (a decode step's are a few
    elements, where every small tensor op costs more than the list). Slots and local lengths use
    :mod:`dcpgraph.layout`'s formulas, on Python ints for steps of at most
    :data:`SMALL_STEP_TOKENS` tokens and on tensors above. ``rows``: the caller's block-table rows
    of earlier steps, reused where a request's row is unchanged or only grew."""
    cu_list, owner_list, position_list, logits_list = [0], [], [], []
    for r, c in enumerate(chunks):
        n = len(c.tokens)
        owner_list += [r] * n
        position_list += range(c.start, c.start + n)
        cu_list.append(cu_list[-1] + n)
        logits_list += range(cu_list[-1] - c.logits_rows, cu_list[-1])
    cu = torch.tensor(cu_list, dtype=torch.int32)
    starts = torch.tensor([c.start for c in chunks], dtype=torch.int64)
    ids = torch.tensor([t for c in chunks for t in c.tokens], dtype=torch.int64)
    positions = torch.tensor(position_list, dtype=torch.int64)
    rows = rows or TableRows()
    table = _table(rows.tables("full", [(c.request_id, c.block_table) for c in chunks]))
    sliding = (None if chunks[0].sliding_table is None
               else _table(rows.tables("sliding", [(c.request_id, c.sliding_table) for c in chunks])))
    shared = {
        "input_ids": ids.unsqueeze(0),
        "position_ids": positions.unsqueeze(0),
        "cu_seqlens_q": cu,
        "context_lens": starts.to(torch.int32),
        "block_table": table,
        "logits_indices": torch.tensor(logits_list, dtype=torch.int64),
    }
    if sliding is not None:
        shared["block_table_sliding"] = sliding
    if chunks[0].state_slot is not None:
        shared["state_slots"] = torch.tensor([c.state_slot for c in chunks], dtype=torch.int64)
    small = len(position_list) <= SMALL_STEP_TOKENS  # a few tokens: the same formulas on Python ints
    owner = None if small else torch.tensor(owner_list, dtype=torch.int64)

    def slots(d: int, rows_of, tensor_table: torch.Tensor) -> torch.Tensor:
        """Each token's slot on DCP rank ``d`` in the table ``rows_of(chunk)`` / ``tensor_table``."""
        if not small:
            return layout.slot_mapping(positions, tensor_table[owner], d, mesh.dcp, block_size, interleave)
        layout.check_slot_args(d, mesh.dcp, block_size, interleave)
        return torch.tensor([layout.slot_of(p, rows_of(chunks[o]), d, mesh.dcp, block_size, interleave)
                             for p, o in zip(position_list, owner_list)], dtype=torch.int64)

    per_rank = []
    for rank in mesh.ranks:
        d = mesh.dcp_rank(rank)
        local = (torch.tensor([layout.local_len(c.start, d, mesh.dcp, interleave) for c in chunks], dtype=torch.int32)
                 if small else layout.local_len(starts, d, mesh.dcp, interleave).to(torch.int32))
        own = {
            "slot_mapping": slots(d, lambda c: c.block_table, table),
            "local_context_lens": local,
            "tp_rank": torch.tensor(mesh.tp_rank(rank), dtype=torch.int64),
            "dcp_rank": torch.tensor(d, dtype=torch.int64),
        }
        if sliding is not None:
            own["slot_mapping_sliding"] = slots(d, lambda c: c.sliding_table, sliding)
        per_rank.append(own)
    if mesh.pcp > 1:
        add_pcp_rows(shared, per_rank, [len(c.tokens) for c in chunks], mesh)
    return shared, per_rank


def _table(rows: list[torch.Tensor]) -> torch.Tensor:
    """``[R, W]`` int32 block table of the rows, zero-padded to the widest (padding is never read)."""
    if len(rows) == 1:
        return rows[0].view(1, -1)
    width = max(r.numel() for r in rows)
    table = torch.zeros(len(rows), width, dtype=torch.int32)
    for i, r in enumerate(rows):
        table[i, : r.numel()] = r
    return table
