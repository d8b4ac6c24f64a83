"""Prefix caching over virtual blocks (``dcpgraph.compile(..., enable_prefix_caching=True)``).

Model: ``dcpgraph.models.build_model("llama", seed=2)`` (fp64, 1 KV head, so tp=2/dcp=2 is
valid; seed 2 gives varied greedy outputs), traced once. References: HF ``generate`` prompt by
prompt. ``block_size`` 4, so a virtual block is 4 tokens at dcp=1 and 8 at dcp=2.

Covered: two rounds of requests sharing a long prefix give HF's tokens and the tokens of the same
engine without prefix caching, and the second round hits and computes fewer prompt tokens (tp=2/
dcp=2 at interleave 1 and block_size, tp=1/dcp=1); a prompt that is an exact multiple of the
virtual block recomputes its last block; blocks holding generated tokens are cached too; the KV
a request reads from shared blocks equals what recomputation writes, on every rank; slot mapping
of the recomputed tail equals the tail of the full prompt's; refcounting (shared blocks stay while
any user runs; the reservation counts them once) and LRU eviction of cached free blocks, with
correct tokens after eviction; an MLA model (deepseek_v2) at tp=2/dcp=2; with prefix caching off
the schedule and block tables are those of a FIFO free queue; the ``BlockManager`` invariants (no
writes into shared or hashed blocks).
"""

from __future__ import annotations

import pytest
import torch

import dcpgraph
from dcpgraph import layout
from dcpgraph.models import build_model
from dcpgraph.runtime.blocks import BlockManager, block_hashes
from dcpgraph.runtime.step_inputs import Chunk, build_step_inputs
from dcpgraph.testing.generation import drain, hf_greedy

BLOCK_SIZE = 4
PREFIX = [(7 * i + 3) % 256 for i in range(26)]  # 26 tokens: 3 full virtual blocks at dcp=2, 6 at dcp=1
ROUND1 = [PREFIX + [100, 50, 1], PREFIX + [101, 51]]
ROUND2 = [PREFIX + [102, 52, 19, 7], PREFIX + [103], PREFIX[:20] + [9, 9, 9]]
NEW = 8


class Setup:
    def __init__(self) -> None:
        self.model = build_model("llama", seed=2)
        self.program = dcpgraph.trace(self.model)
        self._refs: dict[tuple[int, ...], list[int]] = {}

    def ref(self, prompt, n: int = NEW) -> list[int]:
        key = tuple(prompt)
        if key not in self._refs or len(self._refs[key]) < n:
            with torch.no_grad():
                out = self.model.generate(torch.tensor([list(prompt)]), max_new_tokens=max(n, NEW),
                                          do_sample=False, pad_token_id=0)
            self._refs[key] = out[0, len(prompt):].tolist()
        return self._refs[key][:n]

    def engine(self, tp: int, dcp: int, **kw):
        kw = {"block_size": BLOCK_SIZE, "max_num_batched_tokens": 16, "max_model_len": 64, **kw}
        return dcpgraph.compile(self.program, tp=tp, dcp=dcp, **kw)


@pytest.fixture(scope="module")
def setup() -> Setup:
    return Setup()


def _stats(engine) -> dict:
    return dict(engine.report()["prefix_cache"])


def _kv(engine, table: list[int], length: int) -> list[dict[str, torch.Tensor]]:
    """Per rank, the KV of positions [0, length) that the rank owns (by ``layout.slot_mapping``)."""
    positions = torch.arange(length)
    rows = torch.tensor(table).expand(length, -1)
    out = []
    for rank in engine.mesh.ranks:
        d = engine.mesh.dcp_rank(rank)
        slots = layout.slot_mapping(positions, rows, d, engine.mesh.dcp, engine.block_size, engine.interleave)
        slots = slots[slots >= 0]
        out.append({name: c.reshape(-1, *c.shape[2:])[slots].clone()
                    for name, c in engine.executor.caches[rank].items()})
    return out


# -- two rounds sharing a prefix -------------------------------------------------------------------
@pytest.mark.parametrize(("tp", "dcp", "interleave"), [(2, 2, 1), (2, 2, BLOCK_SIZE), (1, 1, 1)],
                         ids=["tp2-dcp2-il1", "tp2-dcp2-il4", "tp1-dcp1"])
def test_two_rounds_match_hf_and_the_uncached_engine(setup, tp, dcp, interleave):
    cached = setup.engine(tp, dcp, interleave=interleave, enable_prefix_caching=True)
    plain = setup.engine(tp, dcp, interleave=interleave)
    vblock = BLOCK_SIZE * dcp
    computed = {}
    for name, engine in (("cached", cached), ("plain", plain)):
        for prompts in (ROUND1, ROUND2):
            before = _stats(engine)
            got = engine.generate(prompts, NEW)
            assert got == [setup.ref(p) for p in prompts], (name, len(prompts))
            after = _stats(engine)
            computed[name, len(prompts)] = after["prompt_tokens_computed"] - before["prompt_tokens_computed"]
            hits = after["hit_tokens"] - before["hit_tokens"]
            assert hits % vblock == 0
            if name == "plain":
                assert hits == 0 and computed[name, len(prompts)] == sum(len(p) for p in prompts)
        assert engine.blocks.free_blocks == engine.blocks.num_blocks and not engine.scheduler.has_work()
    stats = _stats(cached)
    assert stats["enabled"] and stats["queries"] == len(ROUND1) + len(ROUND2)
    assert stats["query_tokens"] == sum(len(p) for p in ROUND1 + ROUND2)
    # round 2: every prompt reuses the full virtual blocks of PREFIX (the third only its first 20
    # tokens' worth), so it computes strictly fewer prompt tokens than the plain engine
    shared = [min(len(PREFIX), 20 if i == 2 else 26, len(p) - 1) // vblock for i, p in enumerate(ROUND2)]
    r2_hits = sum(shared) * vblock
    assert r2_hits > 0 and computed["cached", len(ROUND2)] == computed["plain", len(ROUND2)] - r2_hits
    assert computed["cached", len(ROUND2)] < computed["plain", len(ROUND2)]
    assert stats["hit_tokens"] >= r2_hits and stats["cached_blocks"] > 0
    assert stats["evictions"] == 0
    plain_stats = _stats(plain)
    assert not plain_stats["enabled"] and plain_stats["hit_tokens"] == plain_stats["cached_blocks"] == 0
    assert cached.memory_report()["prefix_cache"]["cached_blocks"] == stats["cached_blocks"]


def test_prompt_that_is_a_multiple_of_the_virtual_block(setup):
    """The last block of a prompt is never fully reused: a repeated 3-block prompt hits 2 blocks and
    recomputes the third into its own block; a 1-block prompt never hits."""
    engine = setup.engine(2, 2, interleave=2, enable_prefix_caching=True)
    vblock = BLOCK_SIZE * 2
    prompt = PREFIX[:3 * vblock - 2] + [77, 78]
    one = PREFIX[5:5 + vblock]
    assert len(prompt) == 3 * vblock and len(one) == vblock
    for rnd in range(2):
        before = _stats(engine)
        assert engine.generate([prompt], NEW) == [setup.ref(prompt)]
        after = _stats(engine)
        assert after["hit_tokens"] - before["hit_tokens"] == (0 if rnd == 0 else 2 * vblock)
        assert after["prompt_tokens_computed"] - before["prompt_tokens_computed"] == (
            len(prompt) if rnd == 0 else vblock)
    for _ in range(2):
        before = _stats(engine)
        assert engine.generate([one], NEW) == [setup.ref(one)]
        assert _stats(engine)["hit_tokens"] == before["hit_tokens"]
    # blocks holding generated tokens are cached too, once computed (the last sampled token never
    # is): 10 new tokens fill block 3; prompt + 9 of them then hits 4 blocks
    assert engine.generate([prompt], vblock + 2) == [setup.ref(prompt, vblock + 2)]
    follow = prompt + setup.ref(prompt, vblock + 2)[:vblock + 1]
    before = _stats(engine)
    assert engine.generate([follow], 4) == [setup.ref(follow, 4)]
    assert _stats(engine)["hit_tokens"] - before["hit_tokens"] == 4 * vblock


def test_slot_mapping_of_the_recomputed_tail_is_unchanged():
    """A chunk starting after the shared blocks gets exactly the slots the full prompt's chunk gives
    those positions, on every rank (the slots come from positions + the shared table)."""
    mesh = dcpgraph.Mesh(2, 2)
    table = (5, 2, 7, 0)
    tokens = tuple(range(27))
    for interleave in (1, 2, BLOCK_SIZE):
        _, full = build_step_inputs([Chunk(0, tokens, 0, table)], mesh, BLOCK_SIZE, interleave)
        _, tail = build_step_inputs([Chunk(0, tokens[16:], 16, table)], mesh, BLOCK_SIZE, interleave)
        for f, t in zip(full, tail):
            assert torch.equal(f["slot_mapping"][16:], t["slot_mapping"])
            assert set(t["slot_mapping"].tolist()) - {-1} <= {b * BLOCK_SIZE + i for b in (7, 0) for i in range(4)}


# -- refcounting, the reservation and eviction ------------------------------------------------------
def test_shared_blocks_live_until_both_requests_finish_then_get_evicted(setup):
    """num_blocks=4 virtual blocks of 8 tokens; a request of 20 + 4 tokens needs 3. Two such
    requests sharing 2 prefix blocks run *together* without preemption only because an allocation
    counts shared blocks once. The KV each reads from the shared blocks equals what recomputing writes, on every
    rank. Then an unrelated request needing all 4 blocks evicts the cached ones, and still gives
    HF's tokens, as does the first prompt again (now a miss)."""
    engine = setup.engine(2, 2, interleave=1, enable_prefix_caching=True, num_blocks=4, max_model_len=32)
    plain = setup.engine(2, 2, interleave=1, num_blocks=4, max_model_len=32)
    blocks = engine.blocks
    a_prompt, b_prompt = PREFIX[:18] + [40, 41], PREFIX[:18] + [42, 43]
    outputs: dict[int, list[int]] = {}
    a = engine.add_request(a_prompt, 3)
    while engine.scheduler.running == [] or engine.scheduler.running[0].computed < 16:
        for rid, token, _ in engine.step():
            outputs.setdefault(rid, []).append(token)
    assert blocks.cached_blocks == 2 and blocks.free_blocks == 2  # on demand: a holds what it filled
    b = engine.add_request(b_prompt, 4)
    for rid, token, _ in engine.step():
        outputs.setdefault(rid, []).append(token)
    table_a, table_b = list(blocks.table(a)), list(blocks.table(b))
    assert [r.id for r in engine.scheduler.running] == [a, b]  # admitted next to a: shared blocks counted once
    assert engine.report()["scheduler"]["preemptions"] == 0
    assert table_b[:2] == table_a[:2] and table_b[2] not in table_a
    assert [blocks.refcount(x) for x in table_a[:2]] == [2, 2] and blocks.free_blocks == 0
    assert blocks.shared_blocks(b) == 2
    # the shared prefix on every rank holds what the plain engine computes for b's prompt
    p = plain.add_request(b_prompt, 4)
    for _ in range(2):
        plain.step()
    assert plain.scheduler.running[0].computed >= 16
    for mine, theirs in zip(_kv(engine, table_b, 16), _kv(plain, plain.blocks.table(p), 16)):
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    # a finishes first: the shared blocks stay (b still uses them)
    while a in {r.id for r in engine.scheduler.running}:
        for rid, token, _ in engine.step():
            outputs.setdefault(rid, []).append(token)
    assert b in {r.id for r in engine.scheduler.running}
    assert [blocks.refcount(x) for x in table_a[:2]] == [1, 1]
    assert blocks.free_blocks == 1  # only a's own third block came back
    drain(engine, outputs)
    assert outputs[a] == setup.ref(a_prompt, 3) and outputs[b] == setup.ref(b_prompt, 4)
    assert [blocks.refcount(x) for x in table_a[:2]] == [0, 0]
    assert blocks.free_blocks == blocks.num_blocks and blocks.cached_blocks == 2  # cached, free
    # an unrelated request needing every block evicts the cached ones
    other = [200 + i for i in range(26)]
    assert engine.generate([other], 6) == [setup.ref(other, 6)]
    stats = _stats(engine)
    assert stats["evictions"] == 2 and blocks.match_prefix(a_prompt) == []
    before = stats["hit_tokens"]
    assert engine.generate([a_prompt], NEW - 4) == [setup.ref(a_prompt, NEW - 4)]
    assert _stats(engine)["hit_tokens"] == before  # a miss now, and still right


def test_lru_eviction_and_allocation_counting():
    m = BlockManager(5, 4, enable_prefix_caching=True)
    x, y = list(range(10, 19)), list(range(50, 59))
    assert m.allocate(0, 9) == [0, 1, 2]
    m.register(0, x, 9)  # blocks 0, 1 full; 2 is not
    m.release(0)  # tail first: 2 to the free queue, then 1, 0 cached (1 least recent)
    assert m.allocate(1, 9) == [3, 4, 2]  # never-hashed blocks (unused, then released) before cached ones
    m.register(1, y, 8)
    m.release(1)
    assert m.free_blocks == 5 and m.cached_blocks == 4
    assert m.allocate(2, 4) == [2]
    assert m.allocate(3, 4) == [1]  # evicts the least recently released cached block
    assert m.match_prefix(x) == [0] and m.stats["evictions"] == 1
    # an allocation counts a revived cached block once: y's 2 blocks + 1 new = 3 of the 3 free
    prefix = m.match_prefix(y + [1])
    assert prefix == [3, 4] and m.can_allocate(12, prefix) and not m.can_allocate(13, prefix)
    assert m.allocate(4, 12, prefix) == [3, 4, 0]  # x's root evicted for the new block, not a hit
    assert m.match_prefix(x) == [] and m.free_blocks == 0 and m.stats["evictions"] == 2
    with pytest.raises(AssertionError, match="shared prefix"):
        m.check_writable(4, 7, 9)
    m.check_writable(4, 8, 12)
    m.release(2)
    assert m.allocate(5, 4) == [2]
    m.register(5, [1, 2, 3, 4], 4)  # a full block of its own: hashed, so immutable from now on
    with pytest.raises(AssertionError, match="hashed True"):
        m.check_writable(5, 3, 4)
    # a hit held by a running request costs nothing; one that is cached free costs one block
    m.release(3)
    assert m.match_prefix(y + [1]) == [3, 4] and m.can_allocate(9, [3, 4]) and m.free_blocks == 1


def test_block_hashes_are_chained_and_stable():
    a = block_hashes(list(range(12)), 4)
    assert len(a) == 3 and block_hashes(list(range(12)), 4, limit=2) == a[:2]
    assert block_hashes(list(range(4, 12)), 4, parent=a[0]) == a[1:]
    assert block_hashes([9] + list(range(1, 12)), 4)[2] != a[2]  # a change upstream changes every later hash
    assert a[0].hex()[:16] == "88fece76830f57b4"  # hashlib, not Python's salted hash


# -- off means off -----------------------------------------------------------------------------------
def test_prefix_caching_off_keeps_the_plain_free_list(setup):
    engine = setup.engine(2, 2, interleave=2, num_blocks=10, max_num_seqs=2)  # two requests fit
    blocks = engine.blocks
    events = []  # ("take", blocks appended to a table) / ("release", the table given back)
    allocate, grow, release = blocks.allocate, blocks.grow, blocks.release

    def recording_allocate(rid, tokens, prefix=()):
        assert list(prefix) == []
        events.append(("take", tuple(allocate(rid, tokens, prefix))))
        return blocks.table(rid)

    def recording_grow(rid, tokens):
        before = len(blocks.table(rid))
        grown = grow(rid, tokens)
        events.append(("take", tuple(blocks.table(rid)[before:])))
        return grown

    def recording_release(rid):
        events.append(("release", tuple(blocks.table(rid))))
        release(rid)

    blocks.allocate, blocks.grow, blocks.release = recording_allocate, recording_grow, recording_release
    prompts = ROUND1 + ROUND2 + ROUND1
    assert engine.generate(prompts, NEW) == [setup.ref(p) for p in prompts]
    stats = _stats(engine)
    assert stats["prompt_tokens_computed"] == sum(len(p) for p in prompts)
    assert (stats["hit_tokens"], stats["queries"], stats["cached_blocks"]) == (0, 0, 0)
    assert blocks.match_prefix(prompts[0]) == [] and blocks.free_blocks == 10
    assert engine.report()["scheduler"]["preemptions"] == 0
    # every block handed out is a FIFO free queue's next (unused ids in order, then least recently released)
    free = list(range(10))
    for op, table in events:
        if op == "take":
            assert table == tuple(free.pop(0) for _ in table)
        else:
            free.extend(reversed(table))  # released tail first
    assert sum(op == "release" for op, _ in events) == len(prompts)


# -- MLA -------------------------------------------------------------------------------------------
def test_mla_prefix_hits_match_hf():
    """The latent cache is shared the same way (one virtual block on every DCP rank at once)."""
    model = build_model("deepseek_v2", seed=1)
    engine = dcpgraph.compile(dcpgraph.trace(model), tp=2, dcp=2, interleave=2, block_size=BLOCK_SIZE,
                              enable_prefix_caching=True, max_num_batched_tokens=16, max_model_len=64)
    prompts = [PREFIX + [100 + i, 50 + i, 9 * i + 1] for i in range(3)]
    refs = [hf_greedy(model, p, 6) for p in prompts]
    assert engine.generate(prompts[:1], 6) + engine.generate(prompts[1:], 6) == refs
    stats = _stats(engine)
    assert stats["hit_tokens"] == 2 * 3 * BLOCK_SIZE * 2
    assert stats["prompt_tokens_computed"] == sum(len(p) for p in prompts) - stats["hit_tokens"]


def test_registered_hash_is_the_chain_of_the_registered_blocks():
    """The state prefix cache keys a kept state by the hash of a request's last full block, read
    from the block manager's chain (no rehash of the whole context at every block boundary)."""
    m = BlockManager(8, 4, enable_prefix_caching=True)
    tokens = list(range(3, 17))  # 3 full blocks of 4, and 2 tokens more
    m.allocate(1, len(tokens))
    m.register(1, tokens, 8)
    assert m.registered_hash(1, 2) == block_hashes(tokens[:8], 4)[-1]
    assert m.registered_hash(1, 3) is None  # not hashed yet
    m.register(1, tokens, 12)
    assert m.registered_hash(1, 3) == block_hashes(tokens[:12], 4)[-1]
    assert m.registered_hash(1, 2) is None  # the chain has moved on
    assert m.registered_hash(2, 1) is None  # not a request it holds
