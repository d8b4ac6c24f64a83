"""The compiled engine with pcp > 1 on DeepSeek-V4 compressed attention: greedy tokens against HF.

Model: :mod:`dsv4_models` with one layer of each compressed kind (HCA at rate 4, CSA at rate 2
with its indexer keeping 3 entries), window 6, fp64: the prompts outgrow the window and the
selection, so the raw window, the entries, the selection and the sinks all decide what a query
reads. ``split_pcp_prefill`` gathers each compressor's inputs, the indexer's operands and the
attention's query, K=V head and entries over the PCP group in step order, so every rank pools,
selects and attends every step row as ``pcp = 1`` does. Every case prefills in steps of at most
8 tokens (``max_num_batched_tokens``) shared by up to four requests, so requests' chunks cross
window and entry boundaries at varying offsets, and each chunk's rows are dealt zigzag over the
PCP ranks, so windows and entries span ranks; 4-token blocks; a second and third round hit the
prefix cache (the open windows kept at a block boundary are restored). Reference: HF ``generate(do_sample=False)`` prompt by prompt. (2,2,2),
(2,2,1) and the four-layer model with a sliding layer gave the same tokens, by hand.
"""

from __future__ import annotations

import dsv4_models
import pytest
import torch

import dcpgraph
from dcpgraph.testing.generation import hf_greedy

BLOCK = 4
NEW = 4
LAYERS = ["heavily_compressed_attention", "compressed_sparse_attention"]
PREFIX = [(11 * i + 5) % dsv4_models.VOCAB for i in range(16)]
ROUNDS = ([list(p) for p in dsv4_models.PROMPTS], [PREFIX + [1, 2], [9]], [PREFIX + [3], PREFIX[:10] + [4, 5]])


@pytest.fixture(scope="module")
def traced():
    model = dsv4_models.build(layer_types=LAYERS, num_hidden_layers=len(LAYERS), mlp_layer_types=["hash_moe", "moe"])
    program = dcpgraph.trace(model)
    return program, {tuple(p): hf_greedy(model, p, NEW) for prompts in ROUNDS for p in prompts}


def _generate(traced, tp: int, pcp: int, dcp: int) -> dcpgraph.Engine:
    program, want = traced
    engine = dcpgraph.compile(program, tp=tp, pcp=pcp, dcp=dcp, block_size=BLOCK, max_num_batched_tokens=8,
                              num_blocks=64, enable_prefix_caching=True, backend="eager")
    for prompts in ROUNDS:
        assert engine.generate(prompts, NEW) == [want[tuple(p)] for p in prompts], (tp, pcp, dcp)
    assert engine.report()["prefix_cache"]["hit_tokens"] >= BLOCK * dcp
    assert engine.scheduler.state_prefix.stats["restored"] >= 1  # open windows restored on a hit
    return engine


def _collectives(engine, name: str, group: str) -> int:
    return sum(1 for n in engine.program.graph_module.graph.nodes
               if n.op == "call_function" and name in str(n.target) and f"dcpgraph.{group}" in n.args)


@pytest.mark.slow  # the V4 export (~10-17 s, shared by the module) and a ~10 s compile on 2 loaded cores
def test_v4_with_pcp_and_dcp_in_one_group_matches_hf_and_gathers_the_compressors(traced):
    """(1,2,2): the DCP group is the two PCP ranks, so after the PCP gathers they hold the same
    queries: each attends them over its shard and the partials are all-gathered (no all-to-all)."""
    engine = _generate(traced, 1, 2, 2)
    # HCA: compressor kv, gate; q, kv, entries. CSA: both compressors' kv, gate; indexer q, weights,
    # keys; q, kv, entries. The LM head's input.
    assert _collectives(engine, "all_gather", "pcp") == 5 + 10 + 1
    assert _collectives(engine, "all_to_all", "dcp") == 0
    assert torch.ops.dcpgraph.compressed_attention_dcp_.default in {n.target for n in engine.program.graph_module.graph.nodes}


@pytest.mark.slow  # a ~10 s compile a mesh on the module's export, on 2 loaded cores
@pytest.mark.parametrize("tp, pcp, dcp", [(1, 2, 1), (2, 2, 4)])
def test_v4_with_pcp_matches_hf(traced, tp, pcp, dcp):
    """(1,2,1): every PCP rank holds the whole cache; (2,2,4): a DCP group spans both TP ranks'
    heads, each held by two PCP ranks, so one copy of each head block is attended and its partial
    sent to both holders."""
    engine = _generate(traced, tp, pcp, dcp)
    assert _collectives(engine, "all_to_all", "dcp") == (2 if dcp > 1 else 0)
