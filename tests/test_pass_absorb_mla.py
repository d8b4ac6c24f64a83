"""``absorb_mla`` on its own, and ``insert_kv_cache`` on its latent result.

Model: ``build_model("deepseek_v2")`` in fp32: 2 layers, 8 heads, ``kv_lora_rank`` R = 32, rope
8, nope 16, v 16. Per layer the pass replaces the ``kv_b_proj`` linear (decompressing the latent
into 8 heads of keys and values) by two matmuls with the absorbed ``W_UK [H, nope, R]`` and
``W_UV^T [H, R, v]``, so attention runs over one KV head of dim ``R + rope = 40`` whose values are
its first ``R`` dims; ``insert_kv_cache`` then keeps one latent cache per layer. That the numbers
are unchanged is checked in ``tests/test_e2e_mla.py`` (absorbed == decompressed == HF).
"""

from __future__ import annotations

import collections

import pytest
import torch

import dcpgraph
from dcpgraph.errors import PassOrderError
from dcpgraph.models import build_model
from dcpgraph.passes.absorb_mla import absorb_mla
from dcpgraph.passes.insert_kv_cache import insert_kv_cache
from dcpgraph.passes.manager import run_passes
from dcpgraph.program import PARAM, ShardRule

LAYERS, HEADS, RANK, ROPE, NOPE, V = 2, 8, 32, 8, 16, 16
aten = torch.ops.aten
dcp_ops = torch.ops.dcpgraph


@pytest.fixture(scope="module")
def traced():
    return dcpgraph.trace(build_model("deepseek_v2", dtype=torch.float32, layers=LAYERS))


@pytest.fixture(scope="module")
def absorbed(traced):
    return run_passes(traced, [absorb_mla])


def op_counts(program) -> collections.Counter:
    return collections.Counter(n.target for n in program.graph_module.graph.nodes if n.op == "call_function")


def attention_shapes(program) -> list[tuple]:
    """(kv heads, key dim, value dim) of each canonical attention."""
    out = []
    for node in program.graph_module.graph.nodes:
        if node.target is dcp_ops.attention.default:
            k, v = (a.meta["val"] for a in node.args[1:3])
            out.append((k.shape[1], k.shape[-1], v.shape[-1]))
    return out


def test_ops_before_and_after(traced, absorbed):
    b, a = op_counts(traced), op_counts(absorbed)
    assert b[dcp_ops.attention.default] == a[dcp_ops.attention.default] == LAYERS
    assert a[aten.linear.default] == b[aten.linear.default] - LAYERS  # kv_b_proj gone
    assert a[aten.matmul.default] == b[aten.matmul.default] + 2 * LAYERS  # q·W_UK and o·W_UV
    assert attention_shapes(traced) == [(HEADS, NOPE + ROPE, V)] * LAYERS
    assert attention_shapes(absorbed) == [(1, RANK + ROPE, RANK)] * LAYERS
    for node in absorbed.graph_module.graph.nodes:
        if node.target is dcp_ops.attention.default:
            v = node.args[2]  # values are a view of the first R dims of the latent key
            assert (v.target, v.args[0], v.args[1:]) == (aten.slice.Tensor, node.args[1], (-1, 0, RANK))


def test_state_entries_added_and_dropped(traced, absorbed):
    added = set(absorbed.state) - set(traced.state)
    dropped = set(traced.state) - set(absorbed.state)
    layers = [f"model.layers.{i}.self_attn.kv_b_proj" for i in range(LAYERS)]
    assert dropped == {f"{p}.weight" for p in layers}
    assert added == {f"{p}.{s}" for p in layers for s in ("absorbed_uk", "absorbed_uv_t")}
    for p in layers:
        assert tuple(absorbed.state[f"{p}.absorbed_uk"].shape) == (HEADS, NOPE, RANK)
        assert tuple(absorbed.state[f"{p}.absorbed_uv_t"].shape) == (HEADS, RANK, V)
    specs = {s.target: s for s in absorbed.inputs}
    assert all(specs[t].kind == PARAM and specs[t].shard == ShardRule(0) for t in added)  # split by heads
    assert not dropped & set(specs)


def test_facts_and_tp_roles(traced, absorbed):
    f = absorbed.facts
    assert (f.num_kv_heads, f.head_dim, f.v_head_dim) == (1, RANK + ROPE, RANK)
    assert (traced.facts.head_dim, traced.facts.v_head_dim) == (NOPE + ROPE, V)
    for i in range(LAYERS):
        assert f.tp_plan[f"model.layers.{i}.self_attn.q_proj"] == "colwise"
        assert f.tp_plan[f"model.layers.{i}.self_attn.o_proj"] == "rowwise"


def test_gqa_model_is_left_alone():
    program = dcpgraph.trace(build_model("llama", dtype=torch.float32, layers=1))
    after = run_passes(program, [absorb_mla])
    assert str(after.graph_module.graph) == str(program.graph_module.graph)
    assert after.state is program.state and after.provenance[-1].summary == "not an MLA model: nothing to absorb"


def test_insert_kv_cache_keeps_one_latent_cache_per_layer(absorbed):
    after = run_passes(absorbed, [insert_kv_cache.with_options(block_size=4)])
    assert [(c.name, c.role, c.heads, c.dim) for c in after.caches] == [
        (f"latent_cache_{i}", "latent", 1, RANK + ROPE) for i in range(LAYERS)
    ]
    counts = op_counts(after)
    assert counts[dcp_ops.kv_cache_write_.default] == LAYERS  # one write per layer, not k and v
    assert counts[dcp_ops.paged_attention.default] == LAYERS
    for node in after.graph_module.graph.nodes:
        if node.target is dcp_ops.paged_attention.default:
            k_cache, v_cache = node.args[1:3]
            assert v_cache.target is aten.slice.Tensor and v_cache.args == (k_cache, -1, 0, RANK)


def test_order_against_insert_kv_cache(traced, absorbed):
    with pytest.raises(PassOrderError, match=r"pass 'insert_kv_cache' requires 'absorb_mla' to have run on an MLA model"):
        run_passes(traced, [insert_kv_cache])
    cached = run_passes(absorbed, [insert_kv_cache])
    with pytest.raises(PassOrderError, match=r"pass 'absorb_mla' requires 'insert_kv_cache' not to have run yet"):
        run_passes(cached, [absorb_mla])
