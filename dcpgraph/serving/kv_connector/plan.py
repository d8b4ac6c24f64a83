"""Which producer rank sends which KV rows to which consumer rank, and how they are packed.

A side (:class:`KVSide`) is one instance's cache layout: ``tp``, ``pcp``, ``dcp``, interleave,
block size, and its caches. Its ``tp·pcp`` ranks are placed in *attention order* ``a = t·pcp + p``
(global rank ``p·tp + t``, :meth:`dcpgraph.mesh.Mesh.attention_index`; ``a = rank`` when ``pcp =
1``): after a PCP prefill every rank holds the tokens its DCP rank ``a % dcp`` owns, so a PCP
side is a DCP side of ``tp·pcp`` attention ranks. KV head ``h`` of a cache lives on the *replica
set* ``g = a // replicas`` (``replicas`` = ``tp·pcp`` for MLA's one latent head, ``max(tp //
num_kv_heads, 1)·pcp`` for GQA), which holds the contiguous global heads ``[g·H, (g+1)·H)``
(``H`` = the cache's heads per rank); inside a replica set each DCP group holds every token, token
``t`` on member ``owner(t) = (t // I) % dcp``. So consumer rank ``c`` needs, for positions ``[start, end)``
it owns and for its heads, rows that live on exactly one rank of the *first* DCP group of each
producer replica set its heads overlap: that rank sends them (:func:`transfer_plan`; plans name
global ranks). This covers
different ``dcp`` and different ``tp`` (heads re-split) on the two sides.

Packing: every pair moves one flat byte buffer, each cache's rows in cache order
(fp8 caches as their bytes, scale caches like any other cache). In *block* mode (both sides
``block_size`` equal and each side ``dcp == 1`` or ``interleave == block_size``) run ``k`` of
``block_size`` consecutive tokens is one whole physical block on both sides (producer rank
``k % dcp_p``, virtual block ``k // dcp_p``; same for the consumer), so whole blocks move as they
are, the last one with its unwritten tail. Otherwise *row* mode moves token rows addressed by
:func:`dcpgraph.layout.slot_mapping` on each side (the general re-shard).

DeepSeek-V4's entry caches (:mod:`dcpgraph.runtime.entry_placement`: one row per compressed entry
``w`` of a layer with rate ``m``) move as rows by entry index in either mode: entries
``[start // m, end // m)``, entry ``w`` on DCP rank ``owner(w)`` of each side (the interleave rule on
entry indices), addressed on each side by :func:`~dcpgraph.runtime.entry_placement.entry_slots`,
the placement the in-process hand-over uses. A pair's buffer carries its token units and its
entry units per rate (:class:`PairPlan`).

A hybrid model's recurrent state (every pool's slot of the request, :func:`pack_states`) is split
over TP by heads and identical on every member of a DCP group, so producer rank ``i`` sends its
own to consumer rank ``i`` (both sides have the same ``tp``, checked by :func:`check_compatible`),
appended after that pair's KV rows. State that is whole on every rank (V4's open windows,
``replicated_states``) goes to consumer rank ``c`` from producer rank ``c mod (tp·pcp)``, whatever
the two ``tp`` (:func:`state_source`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ... import layout
from ...errors import UnsupportedModelError
from ...mesh import Mesh
from ...runtime.entry_placement import entry_slots, is_entry_cache
from ...runtime.kv_transfer import REPLICATED_STATE_ROLES

DTYPES = {str(d): d for d in (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.float8_e4m3fn)}


@dataclass(frozen=True)
class KVSide:
    """One instance's KV cache layout (JSON-able through :meth:`to_json`)."""

    tp: int
    dcp: int
    interleave: int
    block_size: int
    attention: str  # "mla" or "gqa"
    num_kv_heads: int
    caches: tuple[tuple[str, str, int, int, str], ...]  # (name, role, heads per rank, dim, dtype)
    # hybrid models: (name, shape per slot on a rank, dtype) of every recurrent state pool
    states: tuple[tuple[str, tuple[int, ...], str], ...] = ()
    pcp: int = 1  # PCP replicas of the TP group: the side has tp·pcp ranks
    # DeepSeek-V4: (cache name, compress rate m, tokens per row) of every cache with one row per entry
    entries: tuple[tuple[str, int, int], ...] = ()
    replicated_states: bool = False  # every state pool is whole on every rank (V4's open windows)

    @classmethod
    def of_engine(cls, engine) -> KVSide:
        program = engine.program
        facts = program.facts
        if facts.layer_kv_heads:
            raise UnsupportedModelError(
                f"{facts.architecture}: KV transfer between instances (P/D) places every cache's heads by one "
                f"KV head count, and this model's layers have {sorted(set(facts.layer_kv_heads))}; serve it "
                "without a KV connector")
        if program.lowering.sliding_caches:
            raise UnsupportedModelError(
                f"{facts.architecture}: KV transfer between instances (P/D) addresses every cache through the "
                "request's one block table, and hybrid_kv_cache=True gives the sliding-window layers their own; "
                "serve it with hybrid_kv_cache off (the default) or without a KV connector")
        rates = facts.extra.get("compress_rates") or {}
        entries = tuple((c.name, int(rates[c.layer]), int(c.tokens_per_row)) for c in program.caches
                        if is_entry_cache(c))
        pools = program.recurrent_states
        return cls(engine.mesh.tp, engine.mesh.dcp, engine.interleave, engine.block_size, facts.attention,
                   int(facts.num_kv_heads),
                   tuple((c.name, c.role, c.heads, c.dim, str(c.dtype)) for c in program.caches),
                   tuple((p.name, tuple(int(n) for n in p.shape), str(p.dtype)) for p in pools),
                   engine.mesh.pcp, entries,
                   bool(pools) and all(p.role in REPLICATED_STATE_ROLES for p in pools))

    def to_json(self) -> dict:
        return {"tp": self.tp, "dcp": self.dcp, "interleave": self.interleave, "block_size": self.block_size,
                "attention": self.attention, "num_kv_heads": self.num_kv_heads,
                "caches": [list(c) for c in self.caches],
                "states": [[name, list(shape), dtype] for name, shape, dtype in self.states], "pcp": self.pcp,
                "entries": [list(e) for e in self.entries], "replicated_states": self.replicated_states}

    @classmethod
    def from_json(cls, data: dict) -> KVSide:
        return cls(int(data["tp"]), int(data["dcp"]), int(data["interleave"]), int(data["block_size"]),
                   str(data["attention"]), int(data["num_kv_heads"]),
                   tuple((str(n), str(r), int(h), int(d), str(t)) for n, r, h, d, t in data["caches"]),
                   tuple((str(n), tuple(int(x) for x in shape), str(t)) for n, shape, t in data.get("states", ())),
                   int(data.get("pcp", 1)),
                   tuple((str(n), int(m), int(r)) for n, m, r in data.get("entries", ())),
                   bool(data.get("replicated_states", False)))

    @property
    def state_bytes(self) -> int:
        """Bytes of one request's recurrent state on one rank (every pool's slot; 0 without)."""
        return sum(math.prod(shape) * DTYPES[dtype].itemsize for _, shape, dtype in self.states)

    @property
    def ranks(self) -> int:
        """The side's world: ``tp·pcp`` ranks."""
        return self.tp * self.pcp

    @property
    def mesh(self) -> Mesh:
        return Mesh(self.tp, self.dcp, self.pcp)

    def attention_index(self, rank: int) -> int:
        """Global rank ``p·tp + t`` -> attention order ``t·pcp + p`` (the identity when ``pcp = 1``)."""
        return self.mesh.attention_index(rank)

    def rank_at(self, attention_index: int) -> int:
        """Attention order ``t·pcp + p`` -> global rank ``p·tp + t``."""
        t, p = divmod(attention_index, self.pcp)
        return p * self.tp + t

    def dcp_rank(self, rank: int) -> int:
        """The DCP rank of global ``rank``: it holds the tokens ``t`` with ``owner(t)`` equal to it."""
        return self.attention_index(rank) % self.dcp

    @property
    def replicas(self) -> int:
        """Attention ranks holding the same KV heads (a multiple of ``dcp``)."""
        if self.attention == "mla":
            return self.tp * self.pcp
        return (self.tp // self.num_kv_heads if self.tp > self.num_kv_heads else 1) * self.pcp

    @property
    def head_groups(self) -> int:
        return self.ranks // self.replicas

    def head_group(self, rank: int) -> int:
        """The replica set of global ``rank``."""
        return self.attention_index(rank) // self.replicas

    def head_range(self, rank: int, cache: int) -> tuple[int, int]:
        """Global heads ``[lo, hi)`` of cache number ``cache`` on global ``rank``."""
        heads = self.caches[cache][2]
        g = self.head_group(rank)
        return g * heads, (g + 1) * heads

    @property
    def entry_rates(self) -> dict[str, int]:
        """Entry cache name → its compress rate ``m`` (empty without compressed layers)."""
        return {name: rate for name, rate, _ in self.entries}

    def entry_slots(self, rank: int, cache: str, entries: torch.Tensor, table: list[int]) -> torch.Tensor:
        """Flat rows of ``entries`` in entry cache ``cache`` on global ``rank`` (``−1`` where it
        holds none of them): :func:`dcpgraph.runtime.entry_placement.entry_slots` of this side."""
        _, rate, per_row = next(e for e in self.entries if e[0] == cache)
        return entry_slots(table, entries, rate=rate, tokens_per_row=per_row, block_size=self.block_size,
                           dcp=self.dcp, dcp_rank=self.dcp_rank(rank), interleave=self.interleave)

    @property
    def whole_blocks(self) -> bool:
        """Whether every physical block holds one contiguous run of ``block_size`` tokens."""
        return self.dcp == 1 or self.interleave == self.block_size


def check_compatible(producer: KVSide, consumer: KVSide) -> None:
    """Raise ``ValueError`` naming the difference if ``consumer`` cannot take ``producer``'s KV."""
    if producer.attention != consumer.attention or producer.num_kv_heads != consumer.num_kv_heads:
        raise ValueError(f"the two sides serve different models: producer {producer.attention} with "
                         f"{producer.num_kv_heads} KV heads, consumer {consumer.attention} with {consumer.num_kv_heads}")
    if len(producer.caches) != len(consumer.caches):
        raise ValueError(f"producer has {len(producer.caches)} caches, consumer {len(consumer.caches)}")
    for i, (p, c) in enumerate(zip(producer.caches, consumer.caches)):
        p_total, c_total = p[2] * producer.head_groups, c[2] * consumer.head_groups
        if (p[1], p[3], p[4], p_total) != (c[1], c[3], c[4], c_total):
            raise ValueError(f"cache {i} differs: producer (role, dim, dtype, heads) = {(p[1], p[3], p[4], p_total)}, "
                             f"consumer {(c[1], c[3], c[4], c_total)}")
    if producer.entry_rates != consumer.entry_rates:
        raise ValueError(f"the compressed entry caches differ (name: compress rate): producer "
                         f"{producer.entry_rates}, consumer {consumer.entry_rates}")
    replicated = producer.replicated_states and consumer.replicated_states
    if ((producer.states or consumer.states) and not replicated
            and (producer.tp, producer.pcp) != (consumer.tp, consumer.pcp)):
        raise ValueError(f"a hybrid model's recurrent state is split over tp by heads and moves rank to rank, so "
                         f"both sides need the same tp (producer tp={producer.tp}, consumer tp={consumer.tp}; "
                         "any dcp on either side)")
    if producer.states != consumer.states:
        raise ValueError(f"the recurrent state pools differ: producer {list(producer.states)}, "
                         f"consumer {list(consumer.states)}")


def state_source(producer: KVSide, consumer: KVSide, dst: int) -> int:
    """The producer rank that sends consumer rank ``dst`` its recurrent state: the same index, or
    where every pool is whole on every rank (``replicated_states``) rank ``dst mod (tp·pcp)``."""
    return dst % producer.ranks if producer.replicated_states and consumer.replicated_states else dst


def state_rows(side: KVSide, caches: dict[str, torch.Tensor], slot: int) -> list[torch.Tensor]:
    """Slot ``slot`` of every recurrent state pool of ``side`` (in ``side.states`` order), as views."""
    return [caches[name][slot] for name, _, _ in side.states]


def pack_states(side: KVSide, caches: dict[str, torch.Tensor], slot: int) -> torch.Tensor:
    """One request's recurrent state on one rank as bytes (``side.state_bytes`` of them)."""
    parts = [row.contiguous().view(-1).view(torch.uint8) for row in state_rows(side, caches, slot)]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)


def unpack_states(side: KVSide, caches: dict[str, torch.Tensor], slot: int, buffer: torch.Tensor) -> None:
    """Write :func:`pack_states`'s bytes into slot ``slot`` of ``side``'s pools."""
    assert len(buffer) == side.state_bytes, f"state buffer of {len(buffer)} bytes, expected {side.state_bytes}"
    offset = 0
    for row in state_rows(side, caches, slot):
        nbytes = row.numel() * row.element_size()
        row.copy_(buffer[offset : offset + nbytes].view(row.dtype).view(row.shape))
        offset += nbytes


def block_mode(producer: KVSide, consumer: KVSide) -> bool:
    return producer.block_size == consumer.block_size and producer.whole_blocks and consumer.whole_blocks


@dataclass(frozen=True)
class PairPlan:
    """Producer rank ``src`` sends consumer rank ``dst`` the ``units``: global token positions
    (row mode) or run indices ``k`` of tokens ``[k·B, (k+1)·B)`` (block mode); and for each
    compress rate ``m`` of V4's entry caches, ``entries[m]``: the entry indices it sends."""

    src: int
    dst: int
    units: torch.Tensor
    entries: dict[int, torch.Tensor] = field(default_factory=dict)


def _heads_overlap(producer: KVSide, src: int, consumer: KVSide, dst: int) -> bool:
    """Whether the replica sets of ``src`` and ``dst`` share a head (as fractions of all heads)."""
    gp, gc = producer.head_group(src), consumer.head_group(dst)
    np_, nc = producer.head_groups, consumer.head_groups
    return gp * nc < (gc + 1) * np_ and gc * np_ < (gp + 1) * nc


def _owners(side: KVSide, units: torch.Tensor, blocks: bool) -> torch.Tensor:
    """The DCP rank holding each unit: run ``k`` on ``k mod dcp`` (block mode), else the interleave
    rule on the index (a token position, or an entry index of an entry cache)."""
    return units % side.dcp if blocks else layout.owner(units, side.dcp, side.interleave)


def transfer_plan(producer: KVSide, consumer: KVSide, start: int, end: int) -> list[PairPlan]:
    """Every non-empty (producer rank, consumer rank) message for positions ``[start, end)``, by
    global rank; each consumer row of each head is covered exactly once, and so is each of the
    entries ``[start // m, end // m)`` of every entry cache's rate ``m``."""
    blocks = block_mode(producer, consumer)
    if blocks:
        if start % producer.block_size:
            raise ValueError(f"block mode needs a block-aligned start, got {start}")
        units = torch.arange(start // producer.block_size, -(-end // producer.block_size))
    else:
        units = torch.arange(start, end)
    # (units, owners on the producer, owners on the consumer): tokens first, then each rate's entries
    kinds = {None: (units, _owners(producer, units, blocks), _owners(consumer, units, blocks))}
    for rate in sorted(set(producer.entry_rates.values())):
        ids = torch.arange(start // rate, end // rate)
        kinds[rate] = (ids, _owners(producer, ids, False), _owners(consumer, ids, False))
    plans = []
    for dst in range(consumer.ranks):
        for group in range(producer.head_groups):
            first = group * producer.replicas  # the first DCP group of this replica set sends (attention order)
            if not _heads_overlap(producer, producer.rank_at(first), consumer, dst):
                continue
            for d in range(producer.dcp):
                picked = {kind: ids[(c_owner == consumer.dcp_rank(dst)) & (p_owner == d)]
                          for kind, (ids, p_owner, c_owner) in kinds.items()}
                if any(len(sel) for sel in picked.values()):
                    tokens = picked.pop(None)
                    plans.append(PairPlan(producer.rank_at(first + d), dst, tokens, picked))
    return plans


def _cache_view(cache: torch.Tensor, unit_rows: int) -> torch.Tensor:
    flat = cache.view(torch.uint8) if cache.dtype == torch.float8_e4m3fn else cache
    return flat.view(-1, unit_rows, *cache.shape[2:])


def unit_indices(side: KVSide, rank: int, units: torch.Tensor, table: list[int], blocks: bool) -> torch.Tensor:
    """Physical block ids (block mode) or cache slots (row mode) of ``units`` on ``rank``."""
    row = torch.tensor(table, dtype=torch.int64)
    if blocks:
        return row[units // side.dcp]
    rows = row.expand(len(units), -1)
    slots = layout.slot_mapping(units, rows, side.dcp_rank(rank), side.dcp, side.block_size, side.interleave)
    assert bool((slots >= 0).all()), "a planned row is not owned by this rank"
    return slots


def _local_heads(side: KVSide, rank: int, cache: int, other: KVSide, other_rank: int) -> slice:
    """``side``'s local heads of cache ``cache`` that ``other_rank`` of ``other`` also holds
    (both ranges count the same global heads, see :func:`check_compatible`)."""
    lo, hi = side.head_range(rank, cache)
    olo, ohi = other.head_range(other_rank, cache)
    a, b = max(lo, olo), min(hi, ohi)
    return slice(a - lo, b - lo)


def _rows_of(side: KVSide, rank: int, cache: int, pair: PairPlan, table: list[int],
             blocks: bool) -> tuple[torch.Tensor, int]:
    """(indices into the cache viewed as ``[-1, unit_rows, heads, dim]``, ``unit_rows``) of what
    ``pair`` moves of cache number ``cache`` on ``rank``: entry slots of an entry cache, else
    :func:`unit_indices` of the token units."""
    name = side.caches[cache][0]
    rate = side.entry_rates.get(name)
    if rate is None:
        return unit_indices(side, rank, pair.units, table, blocks), side.block_size if blocks else 1
    slots = side.entry_slots(rank, name, pair.entries.get(rate, torch.empty(0, dtype=torch.int64)), table)
    assert bool((slots >= 0).all()), "a planned entry is not owned by this rank"
    return slots, 1


def buffer_bytes(side: KVSide, rank: int, pair: PairPlan, peer: KVSide, peer_rank: int, blocks: bool) -> int:
    """Bytes of ``pair``'s buffer, computed from ``side``'s caches (either end gets the same)."""
    total = 0
    for i, (name, _, _, dim, dtype) in enumerate(side.caches):
        heads = _local_heads(side, rank, i, peer, peer_rank)
        size = torch.empty((), dtype=DTYPES[dtype]).element_size()
        rate = side.entry_rates.get(name)
        if rate is None:
            rows = len(pair.units) * (side.block_size if blocks else 1)
        else:
            rows = len(pair.entries.get(rate, ()))
        total += rows * (heads.stop - heads.start) * dim * size
    return total


def gather(side: KVSide, rank: int, caches: list[torch.Tensor], table: list[int], pair: PairPlan,
           consumer: KVSide, blocks: bool) -> torch.Tensor:
    """The producer's flat byte buffer for ``pair`` from ``rank``'s caches (in cache order)."""
    parts = []
    for i, cache in enumerate(caches):
        index, unit_rows = _rows_of(side, rank, i, pair, table, blocks)
        heads = _local_heads(side, rank, i, consumer, pair.dst)
        rows = _cache_view(cache, unit_rows).index_select(0, index)[:, :, heads]
        parts.append(rows.contiguous().view(-1).view(torch.uint8))
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)


def scatter(side: KVSide, rank: int, caches: list[torch.Tensor], table: list[int], pair: PairPlan,
            producer: KVSide, blocks: bool, buffer: torch.Tensor) -> None:
    """Write ``buffer`` (from :func:`gather` on ``pair.src``) into ``rank``'s caches."""
    offset = 0
    for i, cache in enumerate(caches):
        index, unit_rows = _rows_of(side, rank, i, pair, table, blocks)
        heads = _local_heads(side, rank, i, producer, pair.src)
        view = _cache_view(cache, unit_rows)[:, :, heads]
        shape = (len(index), unit_rows, heads.stop - heads.start, *view.shape[3:])
        nbytes = view.element_size() * math.prod(shape)
        data = buffer[offset : offset + nbytes].view(view.dtype).view(shape)
        view.index_copy_(0, index, data)
        offset += nbytes
    assert offset == len(buffer), f"buffer of {len(buffer)} bytes, {offset} written"
