"""Per-layer-group KV sizing (``hybrid_kv_cache=True``): sliding layers keep only their window.

Correctness against HF ``generate`` (fp64, emulated) on the sliding models of
:mod:`sliding_models` with prompts longer than the window, so blocks really leave the sliding
pool while requests run; the allocator's bookkeeping against a by-hand count; the memory report
against the cache tensors the executor really holds.
"""

from __future__ import annotations

import pytest
import torch
from sliding_models import FEATURES, WINDOW, build, compile_options

import dcpgraph
from dcpgraph.errors import ConfigError, RequestError
from dcpgraph.runtime.layer_groups import (
    NULL_BLOCK,
    HybridBlockManager,
    sliding_pool_blocks,
    split_byte_budget,
    window_blocks,
)
from dcpgraph.testing.generation import drain, hf_greedy

PROMPTS = ((5,), (9, 4, 77), (3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46), tuple(range(40, 61)))
MAX_NEW = 12
BLOCK = 4
_models: dict[str, torch.nn.Module] = {}


def model(name):
    if name not in _models:
        _models[name] = build(name)
    return _models[name]


def run(name, tp, dcp, interleave=1, **kw):
    engine = dcpgraph.compile(model(name), tp=tp, dcp=dcp, interleave=interleave, block_size=BLOCK,
                              max_num_batched_tokens=8, max_num_seqs=4, hybrid_kv_cache=True,
                              **compile_options(name, tp), **kw)
    ids = [engine.add_request(list(p), max_new_tokens=MAX_NEW) for p in PROMPTS]
    out = drain(engine)
    return engine, [out[i] for i in ids]


MESHES = [(1, 1, 1), (2, 2, 2), (4, 4, 1)]


@pytest.mark.parametrize("tp,dcp,interleave", MESHES, ids=[f"tp{m[0]}dcp{m[1]}" for m in MESHES])
@pytest.mark.parametrize("name", ["gemma2", "qwen3", "mistral", "gpt_oss"])
def test_tokens_equal_hf_with_window_sized_sliding_caches(name, tp, dcp, interleave):
    engine, got = run(name, tp, dcp, interleave)
    for prompt, g in zip(PROMPTS, got):
        assert g == hf_greedy(model(name), prompt, MAX_NEW), f"{name} ({FEATURES[name]}) tp{tp}dcp{dcp} len {len(prompt)}"
    groups = engine.memory_report()["kv_layer_groups"]
    assert groups["sliding"]["dropped_blocks"] > 0  # the 21-token prompt outgrew the window
    assert groups["sliding"]["num_blocks"] < groups["full"]["num_blocks"]
    assert engine.blocks.sliding_used_blocks == 0 and engine.blocks.free_blocks == engine.blocks.num_blocks


def test_a_sliding_pool_that_forces_preemption_keeps_tokens(monkeypatch):
    # The smallest pool that still fits any one request alone: concurrent requests outgrow it, so
    # the sliding group (the full pool has room for all) makes the scheduler preempt.
    from dcpgraph.runtime import layer_groups

    def smallest(full_blocks, window, *, step_tokens, tokens_per_block, **_):
        return window_blocks(window, step_tokens, tokens_per_block) + 1

    monkeypatch.setattr(layer_groups, "sliding_pool_blocks", smallest)
    engine = dcpgraph.compile(model("gemma2"), tp=2, dcp=2, block_size=BLOCK, max_num_batched_tokens=8, max_num_seqs=4,
                              hybrid_kv_cache=True, **compile_options("gemma2", 2))
    assert engine.blocks.sliding_blocks == window_blocks(WINDOW, 8, BLOCK * 2) + 1 < engine.blocks.num_blocks
    ids = [engine.add_request(list(p), max_new_tokens=MAX_NEW) for p in PROMPTS]
    out = drain(engine)
    assert engine.scheduler.stats["preemptions"] > 0
    for i, p in zip(ids, PROMPTS):
        assert out[i] == hf_greedy(model("gemma2"), p, MAX_NEW)


def test_memory_report_counts_the_caches_the_ranks_hold():
    engine, _ = run("gemma2", 2, 2)
    report = engine.memory_report()
    groups = report["kv_layer_groups"]
    caches = engine.executor.rank_caches(0)
    held = sum(t.numel() * t.element_size() for t in caches.values())
    assert report["kv_bytes_per_rank"][0] == held == groups["full"]["bytes_per_rank"] + groups["sliding"]["bytes_per_rank"]
    sliding = set(engine.program.lowering.sliding_caches)
    assert sliding and all(caches[n].shape[0] == groups["sliding"]["num_blocks"] for n in sliding)
    assert all(t.shape[0] == groups["full"]["num_blocks"] for n, t in caches.items() if n not in sliding)
    assert groups["saved_bytes_per_rank"] == groups["uniform_bytes_per_rank"] - held > 0


def test_a_byte_budget_buys_more_full_blocks_than_uniform_sizing():
    budget = 200_000
    uniform = dcpgraph.compile(model("gemma2"), tp=1, block_size=BLOCK, kv_cache_bytes_per_rank=budget)
    hybrid = dcpgraph.compile(model("gemma2"), tp=1, block_size=BLOCK, kv_cache_bytes_per_rank=budget,
                              hybrid_kv_cache=True)
    assert hybrid.blocks.num_blocks > uniform.blocks.num_blocks
    assert hybrid.memory_report()["kv_bytes_per_rank"][0] <= budget
    assert hybrid.memory_report()["kv_capacity_tokens"] > uniform.memory_report()["kv_capacity_tokens"]


def test_allocator_drops_only_blocks_before_every_future_window():
    blocks = HybridBlockManager(num_blocks=16, sliding_blocks=6, tokens_per_block=4, window=5)
    blocks.allocate(7, 8)  # positions 0..7, blocks 0 and 1
    assert blocks.group_table(7) == [1, 2] and blocks.sliding_free_blocks == 3
    blocks.trim(7, 8)  # queries >= 8 see keys >= 4: block 0 (positions 0..3) is dead
    assert blocks.group_table(7) == [NULL_BLOCK, 2] and blocks.sliding_free_blocks == 4
    blocks.trim(7, 8)  # idempotent
    assert blocks.sliding_free_blocks == 4
    assert blocks.grow(7, 20)  # blocks 2, 3, 4
    assert len(blocks.group_table(7)) == len(blocks.table(7)) == 5 and blocks.sliding_free_blocks == 1
    assert not blocks.grow(7, 28)  # two more sliding blocks needed, one free: nothing changes
    assert len(blocks.table(7)) == 5 and blocks.sliding_free_blocks == 1
    assert blocks.room(7) == (5 + 1) * 4
    blocks.trim(7, 17)  # keys >= 13: blocks 0..2 dead
    assert blocks.group_table(7)[:3] == [NULL_BLOCK] * 3 and blocks.sliding_free_blocks == 3
    assert not blocks.can_allocate(16)  # 4 sliding blocks needed, 3 free
    blocks.release(7)
    assert blocks.sliding_free_blocks == 5 and blocks.free_blocks == 16


def test_pool_sizes():
    assert window_blocks(5, 8, 4) == 4  # ceil(12 / 4) + 1
    sizes = dict(decode_tokens=1, step_tokens=8, tokens_per_block=4, max_num_seqs=3)
    assert window_blocks(5, 1, 4) == 3  # ceil(5 / 4) + 1
    assert sliding_pool_blocks(100, 5, **sizes) == 3 * 3 + 2 + 1
    assert sliding_pool_blocks(100, 5, **sizes) >= window_blocks(5, 8, 4) + 1  # one request fits alone
    assert sliding_pool_blocks(5, 5, **sizes) == 6  # never above uniform (+ null)
    full = split_byte_budget(10_000, 100, 50, 5, **sizes)
    assert full == (10_000 - 12 * 50) // 100 and full > 10_000 // 150


def test_refusals_name_the_conflict():
    with pytest.raises(ConfigError, match="enable_prefix_caching"):
        dcpgraph.compile(model("gemma2"), tp=1, block_size=BLOCK, hybrid_kv_cache=True, enable_prefix_caching=True)
    with pytest.raises(ConfigError, match="kv_allocation='on_demand'"):
        dcpgraph.compile(model("gemma2"), tp=1, block_size=BLOCK, hybrid_kv_cache=True, kv_allocation="whole_request")
    from dcpgraph.models import build_model

    with pytest.raises(ConfigError, match="needs a model with sliding-window layers"):
        dcpgraph.compile(build_model("llama"), tp=1, hybrid_kv_cache=True)
    engine = dcpgraph.compile(model("gemma2"), tp=1, block_size=BLOCK, hybrid_kv_cache=True)
    with pytest.raises(RequestError, match="hybrid_kv_cache"):
        engine.prefill([5, 9, 4])


def _gloo_rank(rank: int, world: int):
    engine = dcpgraph.compile(build("gemma2"), tp=world, dcp=2, interleave=2, block_size=BLOCK, max_num_batched_tokens=8,
                              max_num_seqs=4, hybrid_kv_cache=True, **compile_options("gemma2", world))
    tokens = engine.generate([list(p) for p in PROMPTS], MAX_NEW)
    groups = engine.memory_report()["kv_layer_groups"]
    return {"tokens": tokens, "executor": engine.report()["executor"], "dropped": groups["sliding"]["dropped_blocks"],
            "sliding_rows": {n: int(t.shape[0]) for n, t in engine.executor.rank_caches(rank).items()
                             if n in engine.program.lowering.sliding_caches}, "pool": groups["sliding"]["num_blocks"]}


@pytest.mark.gloo
@pytest.mark.slow
def test_gloo_window_sized_sliding_caches_generate_hf_tokens():
    from dcpgraph.runtime.distributed import spawn

    results = spawn(_gloo_rank, 2, timeout_s=180)
    reference = [hf_greedy(model("gemma2"), p, MAX_NEW) for p in PROMPTS]
    for rank, result in enumerate(results):
        assert result["executor"] == "distributed" and result["tokens"] == reference, rank
        assert result["dropped"] > 0
        assert result["sliding_rows"] and set(result["sliding_rows"].values()) == {result["pool"]}


def test_speculative_drafts_with_window_sized_sliding_caches():
    # Drafts are written past `computed` into the sliding table's tail; rejected ones are
    # overwritten later, and trimming only ever follows accepted tokens.
    engine, got = run("gemma2", 2, 2, 2, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    for prompt, g in zip(PROMPTS, got):
        assert g == hf_greedy(model("gemma2"), prompt, MAX_NEW)
    assert engine.report()["speculative"]["drafted"] > 0
