"""Where DeepSeek-V4's compressed entries live on a mesh: the placement a KV transfer re-shards by.

An entry cache (roles ``compressed_entries`` and ``compressed_index``: one row per entry ``w`` of a
layer with compress rate ``m``, ``CacheSpec.tokens_per_row`` tokens per row) is addressed through
the request's block table ``T`` of a side with block size ``B``, DCP size ``N`` and interleave
``I``:

* ``N = 1``: entry ``w`` sits in the block of its first token ``w·m``, at row ``(w·m mod B) // m``
  of ``ceil(B / m)`` rows per block: slot ``T[w·m // B]·ceil(B/m) + (w·m mod B) // m``;
* ``N > 1``: the interleave rule applied to **entry indices**: entry ``w`` on DCP rank
  ``owner(w) = (w // I) % N`` at ``layout.slot_mapping(w)`` over blocks of ``R = B // tokens_per_row``
  entries (virtual blocks of ``R·N`` entries); every other rank gets ``−1``.

These are the slots the cached ops write (:mod:`dcpgraph.ops.compressed_cached` at ``N = 1``,
:mod:`dcpgraph.ops.compressed_dcp` at ``N > 1``). A request's closed entries after ``L`` tokens are
``[0, L // m)``; gathered in entry order from one side's owners and scattered with the other side's
placement, they move between any two meshes, as token rows do with :func:`dcpgraph.layout.slot_mapping`.
"""

from __future__ import annotations

import torch

from .. import layout
from ..ops.compressed_cached import entry_slots as _one_rank_slots

ENTRY_ROLES = frozenset({"compressed_entries", "compressed_index"})


def is_entry_cache(spec) -> bool:
    """Whether a :class:`~dcpgraph.program.CacheSpec` holds one row per compressed entry."""
    return spec.role in ENTRY_ROLES


def entry_slots(table_row, entries: torch.Tensor, *, rate: int, tokens_per_row: int, block_size: int, dcp: int,
                dcp_rank: int, interleave: int) -> torch.Tensor:
    """Flat row of each of ``entries`` in DCP rank ``dcp_rank``'s entry cache (``−1`` where that
    rank does not hold it), for the request whose block-table row is ``table_row``."""
    table_row = torch.as_tensor(table_row, dtype=torch.int64)
    entries = entries.to(torch.int64)
    if dcp == 1:
        return _one_rank_slots(table_row, entries, rate, block_size)
    rows = table_row.unsqueeze(0).expand(entries.shape[0], -1)
    return layout.slot_mapping(entries, rows, dcp_rank, dcp, block_size // tokens_per_row, interleave)
