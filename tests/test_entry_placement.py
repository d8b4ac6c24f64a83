"""The placement a V4 KV transfer re-shards entries by (:mod:`dcpgraph.runtime.entry_placement`),
against the writes of the cached ops themselves (:mod:`dcpgraph.ops.compressed_cached` at dcp=1,
:mod:`dcpgraph.ops.compressed_dcp` at dcp > 1): entries written by one layout's ops are found by
the placement, each on exactly one rank, and moved to another layout they are what that layout's
ops read back."""

from __future__ import annotations

import pytest
import torch

from dcpgraph.layout import owner
from dcpgraph.ops import compressed_cached, compressed_dcp
from dcpgraph.passes.insert_compressed_cache import entry_tokens_per_row
from dcpgraph.runtime.entry_placement import entry_slots

TOKENS, DIM, BLOCKS = 37, 3, 24
# (dcp, interleave, block_size): dcp=1, dcp > 1 with interleave 1, runs of entries, whole blocks
LAYOUTS = [(1, 1, 4), (1, 1, 8), (2, 1, 4), (2, 2, 8), (4, 1, 8), (2, 4, 4)]


class Side:
    """One layout's entry caches (one per DCP rank) and one request's shuffled block table."""

    def __init__(self, layout, rate, seed):
        self.dcp, self.interleave, self.block = layout
        self.rate = rate
        self.per_row = entry_tokens_per_row(rate, self.block, self.dcp, self.interleave)
        rows = -(-self.block // self.per_row)
        self.caches = [torch.zeros(BLOCKS, rows, 1, DIM, dtype=torch.float64) for _ in range(self.dcp)]
        self.table = torch.randperm(BLOCKS, generator=torch.Generator().manual_seed(seed))

    def slots(self, entries, rank):
        return entry_slots(self.table, entries, rate=self.rate, tokens_per_row=self.per_row, block_size=self.block,
                           dcp=self.dcp, dcp_rank=rank, interleave=self.interleave)

    def write_by_ops(self, entries_in_row_form):
        positions = torch.arange(TOKENS)
        if self.dcp == 1:
            compressed_cached._write_entries(self.caches[0], self.table, entries_in_row_form, positions, self.rate,
                                             self.block)
        for rank in range(self.dcp if self.dcp > 1 else 0):
            compressed_dcp._write_entries(self.caches[rank], self.table, entries_in_row_form, positions, self.rate,
                                          rank, self.dcp, self.interleave)

    def read_by_ops(self, count):
        """What the ops read: entry index -> row."""
        if self.dcp == 1:
            slots = compressed_cached.entry_slots(self.table, torch.arange(count), self.rate, self.block)
            return dict(enumerate(compressed_cached._read(self.caches[0], slots)[:, 0]))
        out = {}
        for rank in range(self.dcp):
            glob, rows = compressed_dcp._local_entries(self.caches[rank], self.table, count, rank, self.dcp,
                                                       self.interleave)
            out.update(zip(glob.tolist(), rows))
        return out


@pytest.mark.parametrize("rate", [2, 4, 8])
@pytest.mark.parametrize("source", LAYOUTS)
def test_entries_move_between_layouts_by_the_placement(source, rate):
    count = TOKENS // rate
    entries = torch.arange(count)
    rows = torch.randn(count, 1, DIM, generator=torch.Generator().manual_seed(rate), dtype=torch.float64)
    row_form = torch.zeros(TOKENS, 1, DIM, dtype=torch.float64)
    row_form[(entries + 1) * rate - 1] = rows  # the entry a token closes, on its row
    producer = Side(source, rate, seed=1)
    producer.write_by_ops(row_form)
    # the placement finds every entry on its owner, nowhere else, each in its own slot
    owners = owner(entries, producer.dcp, producer.interleave)
    gathered = torch.empty_like(rows)
    for rank in range(producer.dcp):
        slots = producer.slots(entries, rank)
        mine = owners == rank if producer.dcp > 1 else torch.ones(count, dtype=torch.bool)
        assert bool((slots[~mine] == -1).all()) and bool((slots[mine] >= 0).all())
        assert len(set(slots[mine].tolist())) == int(mine.sum())
        gathered[mine] = producer.caches[rank].view(-1, 1, DIM)[slots[mine]]
    torch.testing.assert_close(gathered, rows, rtol=0, atol=0)
    for target in LAYOUTS:
        consumer = Side(target, rate, seed=2)
        for rank in range(consumer.dcp):
            slots = consumer.slots(entries, rank)
            owned = slots >= 0
            consumer.caches[rank].view(-1, 1, DIM)[slots[owned]] = gathered[owned]
        read = consumer.read_by_ops(count)
        assert sorted(read) == entries.tolist(), target
        torch.testing.assert_close(torch.stack([read[w] for w in range(count)]), rows[:, 0], rtol=0, atol=0)
