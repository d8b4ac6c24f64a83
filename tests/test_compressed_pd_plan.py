"""DeepSeek-V4's payload over the connector between serving instances, by hand over ranks in one
process: every producer rank's ``kv.send`` half (:func:`~dcpgraph.serving.kv_connector.rank_ops.send_rows`)
and every consumer rank's ``kv.recv`` half run against an in-memory exchange, on caches written
by the cached ops themselves (:mod:`dcpgraph.ops.compressed_cached` at dcp=1,
:mod:`dcpgraph.ops.compressed_dcp` at dcp > 1). What the consumer's ops then read equals what the
producer's wrote: the raw window by token position, the entries and CSA's indexer keys by entry
index (dealt by the interleave rule on entry indices on each side), and the open windows (whole on
every rank) in the consumer's slot, across tp, dcp, interleave and block size, and from a consumer
prefix hit on."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dcpgraph import layout
from dcpgraph.ops import compressed_cached, compressed_dcp
from dcpgraph.passes.insert_compressed_cache import entry_tokens_per_row
from dcpgraph.program import CacheSpec
from dcpgraph.serving.kv_connector import rank_ops
from dcpgraph.serving.kv_connector.plan import KVSide, check_compatible

TOKENS, DIM, INDEX_DIM, BLOCKS = 37, 3, 2, 40
F64 = "torch.float64"
# (name, layer, role, dim, compress rate or None): a raw window, HCA entries (m=4), CSA entries and keys (m=2)
CACHES = [("compressed_kv_1", 1, "compressed_kv", DIM, None), ("entries_1", 1, "compressed_entries", DIM, 4),
          ("compressed_kv_2", 2, "compressed_kv", DIM, None), ("entries_2", 2, "compressed_entries", DIM, 2),
          ("index_entries_2", 2, "compressed_index", INDEX_DIM, 2)]
POOLS = {"open_window_1": (8, 2 * DIM), "open_window_2": (4, 4 * DIM)}  # per-slot shapes
SLOTS = 3


class Instance:
    """One serving instance's ranks: caches per rank, one request's block table and state slot."""

    def __init__(self, tp, dcp, interleave, block, seed, slot):
        self.tp, self.dcp, self.interleave, self.block, self.slot = tp, dcp, interleave, block, slot
        self.specs = [CacheSpec(name, layer, role, 1, dim, torch.float64,
                                tokens_per_row=1 if rate is None else entry_tokens_per_row(rate, block, dcp, interleave))
                      for name, layer, role, dim, rate in CACHES]
        self.rates = {name: rate for name, _, _, _, rate in CACHES if rate is not None}
        self.table = torch.randperm(BLOCKS, generator=torch.Generator().manual_seed(seed))
        self.ranks = [{s.name: torch.zeros(BLOCKS, s.rows_per_block(block), 1, s.dim, dtype=torch.float64)
                       for s in self.specs} | {n: torch.zeros(SLOTS, *shape, dtype=torch.float64)
                                              for n, shape in POOLS.items()} for _ in range(tp)]
        self.side = KVSide(tp, dcp, interleave, block, "gqa", 1,
                           tuple((s.name, s.role, 1, s.dim, F64) for s in self.specs),
                           tuple((n, shape, F64) for n, shape in POOLS.items()),
                           entries=tuple((s.name, self.rates[s.name], s.tokens_per_row) for s in self.specs
                                         if s.name in self.rates),
                           replicated_states=True)

    def state(self, rank):
        return SimpleNamespace(rank=rank, caches=self.ranks[rank], program=SimpleNamespace(caches=self.specs))

    def write(self, data, states):
        """Every rank writes what the ops write for the whole sequence: the tokens it owns, the
        entries it owns (row form: entry ``w`` on the row of the token that closes it), the states."""
        positions = torch.arange(TOKENS)
        for rank, caches in enumerate(self.ranks):
            d = rank % self.dcp
            for name, rows in data.items():
                rate = self.rates.get(name)
                if rate is None:
                    slots = layout.slot_mapping(positions, self.table.expand(TOKENS, -1), d, self.dcp, self.block,
                                                self.interleave)
                    caches[name].view(-1, 1, rows.shape[-1])[slots[slots >= 0]] = rows[slots >= 0]
                elif self.dcp == 1:
                    compressed_cached._write_entries(caches[name], self.table, rows, positions, rate, self.block)
                else:
                    compressed_dcp._write_entries(caches[name], self.table, rows, positions, rate, d, self.dcp,
                                                  self.interleave)
            for name, value in states.items():
                caches[name][self.slot] = value

    def read(self, rank, name):
        """What rank ``rank``'s ops read of cache ``name``: global index -> row."""
        caches, d, rate = self.ranks[rank], rank % self.dcp, self.rates.get(name)
        if rate is None:
            positions = torch.arange(TOKENS)
            slots = layout.slot_mapping(positions, self.table.expand(TOKENS, -1), d, self.dcp, self.block,
                                        self.interleave)
            return dict(zip(positions[slots >= 0].tolist(), caches[name].view(-1, 1, caches[name].shape[-1])[
                slots[slots >= 0]][:, 0]))
        count = TOKENS // rate
        if self.dcp == 1:
            slots = compressed_cached.entry_slots(self.table, torch.arange(count), rate, self.block)
            return dict(enumerate(compressed_cached._read(caches[name], slots)[:, 0]))
        glob, rows = compressed_dcp._local_entries(caches[name], self.table, count, d, self.dcp, self.interleave)
        return dict(zip(glob.tolist(), rows))


class Exchange:
    """The connector's data plane in memory: a send is kept until its receiver takes it."""

    def __init__(self):
        self.mailbox = {}

    def connector(self):
        return self

    def exchange(self, transfer_id, rank, size, sends, recv_bytes):
        for dst, buf in sends.items():
            assert (rank, dst) not in self.mailbox
            self.mailbox[(rank, dst)] = buf.clone()
        received = {src: self.mailbox.pop((src, rank)) for src in recv_bytes}
        assert {src: len(b) for src, b in received.items()} == recv_bytes
        return received


def _data(seed):
    gen = torch.Generator().manual_seed(seed)
    data = {name: torch.randn(TOKENS, 1, dim, generator=gen, dtype=torch.float64) for name, _, _, dim, _ in CACHES}
    states = {name: torch.randn(shape, generator=gen, dtype=torch.float64) for name, shape in POOLS.items()}
    return data, states


def _expected(name, data, rate, start):
    """Global index -> row the consumer must read for ``[start, TOKENS)`` transferred."""
    if rate is None:
        return {t: data[name][t, 0] for t in range(start, TOKENS)}
    return {w: data[name][(w + 1) * rate - 1, 0] for w in range(start // rate, TOKENS // rate)}


# (tp, dcp, interleave, block_size) of producer and consumer
PAIRS = [((1, 1, 1, 4), (2, 2, 2, 8)),  # tp1 -> tp2·dcp2, entries in runs of 2 per rank, other block size
         ((2, 2, 2, 8), (1, 1, 1, 4)),  # and back
         ((2, 1, 1, 4), (4, 2, 4, 4)),  # tokens in block mode (whole blocks), entries still by entry index
         ((4, 4, 1, 8), (2, 2, 1, 4))]


@pytest.mark.parametrize("start", [0, 16])  # 16: the consumer's own prefix cache holds the first 16 tokens
@pytest.mark.parametrize("producer_mesh, consumer_mesh", PAIRS)
def test_v4_payload_reaches_every_consumer_rank_by_its_own_placement(monkeypatch, producer_mesh, consumer_mesh,
                                                                     start):
    producer, consumer = Instance(*producer_mesh, seed=1, slot=1), Instance(*consumer_mesh, seed=2, slot=2)
    data, states = _data(seed=3)
    producer.write(data, states)
    check_compatible(producer.side, consumer.side)
    exchange = Exchange()
    monkeypatch.setattr(rank_ops, "parse_kv_transfer_config", lambda config: exchange)
    common = dict(transfer_id="t", start=start, end=TOKENS, config={})
    p_json, c_json = producer.side.to_json(), consumer.side.to_json()
    for rank in range(producer.tp):
        rank_ops.send_rows(producer.state(rank), producer.table.tolist(), producer.slot, p_json, consumer=c_json,
                           **common)
    for rank in range(consumer.tp):
        rank_ops.recv_rows(consumer.state(rank), consumer.table.tolist(), consumer.slot, c_json, producer=p_json,
                           **common)
    assert not exchange.mailbox  # every buffer sent was received
    for name, _, _, _, rate in CACHES:
        want = _expected(name, data, rate, start)
        for group in range(consumer.tp // consumer.dcp):  # every DCP group holds every row once
            got = {}
            for d in range(consumer.dcp):
                read = consumer.read(group * consumer.dcp + d, name)
                assert not set(read) & set(got), (name, "held by two ranks of a group")
                got.update(read)
            for index, row in want.items():
                torch.testing.assert_close(got[index], row, rtol=0, atol=0, msg=f"{name}[{index}]")
            below = range(start // rate if rate else start)
            assert all(bool((got[i] == 0).all()) for i in below if i in got), f"{name}: a prefix-cached row was sent"
    for rank in range(consumer.tp):
        for name, value in states.items():
            torch.testing.assert_close(consumer.ranks[rank][name][consumer.slot], value, rtol=0, atol=0)
            assert bool((consumer.ranks[rank][name][0] == 0).all())  # other slots untouched


def test_v4_sides_with_other_compressed_layers_are_refused():
    producer, consumer = Instance(1, 1, 1, 4, seed=1, slot=1), Instance(2, 2, 2, 8, seed=2, slot=2)
    other = KVSide(**{**consumer.side.__dict__, "entries": tuple((n, 2 * m, r) for n, m, r in consumer.side.entries)})
    with pytest.raises(ValueError, match="compressed entry caches differ"):
        check_compatible(producer.side, other)
    split = KVSide(**{**consumer.side.__dict__, "replicated_states": False})
    with pytest.raises(ValueError, match="same tp"):
        check_compatible(producer.side, split)
