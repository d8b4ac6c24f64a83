"""DeepSeek-V4 through ``dcpgraph.compile`` at dcp > 1 (emulated ranks): the compiled engine's
greedy tokens against HF ``generate`` on the tiny model of ``tests/dsv4_models.py`` (window 6,
entries of 2 and 4 tokens, top-3) through chunked prefill and a preemption, and the per-rank KV
bytes per token from ``memory_report`` against the planner's formula at dcp 1 and 4."""

from __future__ import annotations

from fractions import Fraction

import dsv4_models
import pytest
import torch

import dcpgraph
from dcpgraph.plan.compressed_cache import compressed_cache_bytes

BLOCK = 4
PROMPTS = [list(dsv4_models.PROMPTS[3]), [5, 9, 3, 17, 22, 40, 8, 1, 33, 12, 60], [7]]
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def traced_four_groups():
    return dsv4_models.traced(o_groups=4)


@pytest.mark.slow  # the shared V4 export (~25 s, once per process) and ~40 s of two emulated ranks on 2 loaded cores
def test_compiled_v4_at_tp2_dcp2_gives_hf_greedy_tokens(traced_four_groups):
    """tp=2·dcp=2 with interleave = block size (runs of 4 tokens, and of 4 entries, per rank):
    prompts of 1-23 tokens in 5-token prefill chunks crossing window and entry boundaries, 5
    virtual blocks of 8 tokens (one request preempted and recomputed) give HF ``generate``'s
    greedy tokens, and the lowered program holds the DCP forms of the compressed ops. With
    ``hybrid_kv_cache`` the raw windows join the sliding group: their blocks wholly before the
    window go back to the sliding pool (read as the null block from then on), the entries keep the
    full table. (The full-table layout at dcp > 1 runs in ``test_e2e_compressed_gloo``,
    ``test_compressed_pd`` and ``test_compressed_only``.)"""
    from dcpgraph.testing.generation import drain, hf_greedy

    model, program = traced_four_groups
    want = [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]
    engine = dcpgraph.compile(program, tp=2, dcp=2, interleave=BLOCK, block_size=BLOCK, max_num_batched_tokens=5,
                              num_blocks=4, hybrid_kv_cache=True)
    for prompt in PROMPTS:
        engine.add_request(prompt, max_new_tokens=NEW_TOKENS)
    got = drain(engine)
    assert [got[i] for i in range(len(PROMPTS))] == want
    assert engine.scheduler.stats["preemptions"] >= 1
    assert {"compressed_kv_1", "compressed_kv_2", "compressed_kv_3"} <= set(engine.program.lowering.sliding_caches)
    assert not any(name.startswith(("entries_", "index_entries_")) for name in engine.program.lowering.sliding_caches)
    assert engine.blocks.sliding_stats["dropped"] > 0
    targets = {n.target for n in engine.program.graph_module.graph.nodes if n.op == "call_function"}
    dcp_ops = torch.ops.dcpgraph
    assert {dcp_ops.compressed_attention_dcp_.default, dcp_ops.compressed_topk_dcp_.default} <= targets
    assert dcp_ops.compressed_attention_.default not in targets


def _bytes_per_token(engine) -> tuple[Fraction, Fraction]:
    """Per rank, per token of context: (all KV caches, the entries and indexer keys alone)."""
    report = engine.memory_report()
    tokens = BLOCK * engine.mesh.dcp  # one physical block per rank holds a virtual block's share
    by_layer = report["kv_bytes_per_block_by_layer"]
    raw = BLOCK * 32 * 8  # each compressed layer's raw K=V rows: one fp64 row of 32 per token slot
    total = Fraction(sum(by_layer.values()), tokens)
    return total, Fraction(sum(by_layer[i] - raw for i in (1, 2, 3)), tokens)


@pytest.mark.slow  # two compiles of the shared export (no generation), ~10 s
def test_v4_kv_bytes_per_token_at_dcp4_are_a_quarter_and_the_planners(traced_four_groups):
    """tp=4·dcp=4 against tp=4·dcp=1: every rank holds a quarter of the window rows, entries and
    indexer keys (≤ 0.3×), and the entries and indexer keys cost exactly the planner's
    ``compressed_cache_bytes(..., dcp=N).per_token`` = ``Σ (D·b + Di·bi) / (m·N)``."""
    model, program = traced_four_groups
    got = {}
    for dcp in (1, 4):
        engine = dcpgraph.compile(program, tp=4, dcp=dcp, block_size=BLOCK, num_blocks=8)
        got[dcp] = _bytes_per_token(engine)
        planner = compressed_cache_bytes(model.config, context_tokens=64, dcp=dcp, element_bytes=8).per_token
        assert got[dcp][1] == planner
    assert got[4][0] <= Fraction(3, 10) * got[1][0]
    assert got[4][0] == got[1][0] / 4
