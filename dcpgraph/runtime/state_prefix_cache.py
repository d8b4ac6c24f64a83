"""Recurrent state at cached prefixes: prefix caching for hybrid models.

A prefix hit skips a request's cached KV blocks, but a recurrent layer has no per-token cache: it
needs its state after exactly the cached tokens. The state after a prefix is a function of the
prefix's tokens alone, so it can be kept under the prefix's chained block hash
(:func:`~dcpgraph.runtime.blocks.block_hashes`, which fixes every token and position) and reused by
any later request with that prefix, whichever slot it runs in.

Rows: every state pool has ``P`` more rows after the slots and the snapshot rows
(``Lowering.state_prefix_rows``), ``first_row = slots + snapshots``. When a step leaves a running
request's ``computed`` on a virtual-block boundary ``k · tokens_per_block`` (a prefill chunk or a
decode step ending there), its slot is copied to a row kept under the hash of its first ``k``
blocks (least recently used row reused). At admission, a KV prefix hit is cut to its longest
prefix whose last block has a state row; that row is copied into the request's new slot and the
request continues from there (its first chunk's ``context_lens`` is the prefix length, so the ops
read the slot).

Order: the copies travel in the next step's ``state_copies`` (applied by every rank before the
step's graph, all sources read before any destination is written), so a save reads the slot as
the step that computed it left it, even when the slot has been given to a new request meanwhile.
A saved row is visible to lookups only after the step carrying its copy has been built, so a
restore never reads a row whose save is still in flight.
"""

from __future__ import annotations

from collections import OrderedDict


class StatePrefixCache:
    """Block hash → pool row of the recurrent state after that prefix (LRU over ``rows`` rows
    from ``first_row``), and the row copies still to ship."""

    def __init__(self, first_row: int, rows: int):
        if rows < 1:
            raise ValueError(f"a state prefix cache needs at least one row, got {rows}")
        self._unused = list(range(first_row + rows - 1, first_row - 1, -1))
        self._rows: OrderedDict[bytes, int] = OrderedDict()  # shipped: visible to lookups
        self._pending: dict[bytes, int] = {}  # saved in the last postprocess, copy not yet shipped
        self._copies: list[tuple[int, int]] = []  # (source row, destination row), in order
        self.stats = {"saved": 0, "restored": 0, "evicted": 0}

    def lookup(self, block_hash: bytes) -> int | None:
        return self._rows.get(block_hash)

    def save(self, block_hash: bytes, slot: int) -> None:
        """Keep ``slot``'s state (after the prefix ``block_hash`` names) in a row."""
        if block_hash in self._rows or block_hash in self._pending:
            if block_hash in self._rows:
                self._rows.move_to_end(block_hash)
            return
        if self._unused:
            row = self._unused.pop()
        elif self._rows:
            _, row = self._rows.popitem(last=False)
            self.stats["evicted"] += 1
        else:
            return  # every row is in flight this step
        self._pending[block_hash] = row
        self._copies.append((slot, row))
        self.stats["saved"] += 1

    def restore(self, block_hash: bytes, slot: int) -> None:
        row = self._rows[block_hash]
        self._rows.move_to_end(block_hash)
        self._copies.append((row, slot))
        self.stats["restored"] += 1

    def take_copies(self) -> list[tuple[int, int]]:
        """The copies for the step being built; the rows they fill become visible to lookups."""
        copies, self._copies = self._copies, []
        self._rows.update(self._pending)
        self._pending = {}
        return copies
