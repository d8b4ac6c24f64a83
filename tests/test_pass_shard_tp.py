"""``shard_tp`` on its own: collectives inserted, shard rules of the state, local shapes.

Model: ``build_model("llama")`` in fp32: 2 layers, 8 query heads, 1 KV head, head dim 8, hidden
64, MLP 128, vocab 256, HF's ``tp_plan`` (q/k/v/gate/up colwise, o/down rowwise, ``lm_head``
colwise_gather_output). Expected counts follow from that plan, per rank:

- all-reduce over TP: one after each rowwise linear (o_proj, down_proj: 2 per layer) and one after
  the vocab-parallel embedding, ``2·L + 1``;
- all-gather over TP: one, of the LM head's output;
- with 1 KV head and ``tp > 1`` the K/V projections stay whole on every rank (``parts = 1``).
"""

from __future__ import annotations

import collections

import pytest
import torch

import dcpgraph
from dcpgraph.errors import PassOrderError
from dcpgraph.mesh import Mesh
from dcpgraph.models import build_model
from dcpgraph.passes.collectives import collective_group
from dcpgraph.passes.insert_kv_cache import insert_kv_cache
from dcpgraph.passes.manager import run_passes
from dcpgraph.passes.select_logits import select_logits
from dcpgraph.passes.shard_tp import shard_tp
from dcpgraph.program import RANK, ShardRule

LAYERS, HEADS, HEAD_DIM, HIDDEN, MLP, VOCAB = 2, 8, 8, 64, 128, 256
c10d = torch.ops._c10d_functional
aten = torch.ops.aten


@pytest.fixture(scope="module")
def before():
    traced = dcpgraph.trace(build_model("llama", dtype=torch.float32, layers=LAYERS))
    return run_passes(traced, [insert_kv_cache.with_options(block_size=4), select_logits])


@pytest.fixture(scope="module")
def sharded(before):
    return {tp: run_passes(before, [shard_tp.with_options(mesh=Mesh(tp))]) for tp in (2, 4)}


def collectives(program) -> collections.Counter:
    return collections.Counter(
        (n.target, collective_group(n)[0]) for n in program.graph_module.graph.nodes if collective_group(n)
    )


def local_shapes(program) -> dict[str, tuple[int, ...]]:
    tp = program.mesh.tp
    return {s.target: s.shard.local_shape(tuple(program.state[s.target].shape), tp)
            for s in program.inputs if s.kind == "param"}


@pytest.mark.parametrize("tp", [2, 4])
def test_collectives_inserted(before, sharded, tp):
    after = sharded[tp]
    assert collectives(before) == {}
    assert collectives(after) == {
        (c10d.all_reduce.default, "tp"): 2 * LAYERS + 1,
        (c10d.all_gather_into_tensor.default, "tp"): 1,
    }
    waits = [n for n in after.graph_module.graph.nodes if n.target is c10d.wait_tensor.default]
    assert len(waits) == 2 * LAYERS + 2  # every collective is waited on
    gather = next(n for n in after.graph_module.graph.nodes if n.target is c10d.all_gather_into_tensor.default)
    assert gather.args[1] == tp


@pytest.mark.parametrize("tp", [2, 4])
def test_shard_rules_and_local_shapes(before, sharded, tp):
    after = sharded[tp]
    assert all(s.shard == ShardRule() for s in before.inputs)
    assert after.state is before.state  # shards are computed at run time, nothing added or dropped
    shapes = local_shapes(after)
    layer = "model.layers.0"
    assert shapes[f"{layer}.self_attn.q_proj.weight"] == (HEADS * HEAD_DIM // tp, HIDDEN)
    assert shapes[f"{layer}.self_attn.k_proj.weight"] == (HEAD_DIM, HIDDEN)  # 1 KV head on every rank
    rules = {s.target: s.shard for s in after.inputs}
    assert rules[f"{layer}.self_attn.k_proj.weight"] == ShardRule(0, 1)
    assert shapes[f"{layer}.self_attn.o_proj.weight"] == (HIDDEN, HEADS * HEAD_DIM // tp)
    assert shapes[f"{layer}.mlp.gate_proj.weight"] == (MLP // tp, HIDDEN)
    assert shapes[f"{layer}.mlp.down_proj.weight"] == (HIDDEN, MLP // tp)
    assert shapes[f"{layer}.input_layernorm.weight"] == (HIDDEN,)
    assert shapes["model.embed_tokens.weight"] == (VOCAB // tp, HIDDEN)
    assert shapes["lm_head.weight"] == (VOCAB // tp, HIDDEN)
    assert [s.name for s in after.inputs] == [s.name for s in before.inputs] + ["tp_rank"]
    assert after.spec("tp_rank").kind == RANK and after.mesh == Mesh(tp)
    assert [c.heads for c in after.caches] == [1] * 2 * LAYERS


@pytest.mark.parametrize("tp", [2, 4])
def test_rank_local_values(sharded, tp):
    """Shape propagation on rank 0's shards: local heads in attention, full vocab after the gather."""
    after = sharded[tp]
    paged = [n for n in after.graph_module.graph.nodes if n.target is torch.ops.dcpgraph.paged_attention.default]
    assert [tuple(n.args[0].meta["val"].shape) for n in paged] == [(6, HEADS // tp, HEAD_DIM)] * LAYERS
    logits = next(n for n in reversed(after.graph_module.graph.nodes) if n.op == "output").args[0][0]
    assert tuple(logits.meta["val"].shape) == (1, 2, VOCAB)  # 2 selected rows of the example


def test_tp1_changes_only_the_mesh(before):
    after = run_passes(before, [shard_tp.with_options(mesh=Mesh(1))])
    assert str(after.graph_module.graph) == str(before.graph_module.graph)
    assert after.inputs == before.inputs and after.provenance[-1].summary == "tp=1: nothing to shard"


def test_requires_the_cache_and_runs_once(before, sharded):
    traced = before.stage("canonicalize_attention")
    with pytest.raises(PassOrderError, match=r"pass 'shard_tp' requires 'insert_kv_cache' to have run .*"
                       r"stages so far: \['trace', 'canonicalize_attention'\]"):
        run_passes(traced, [shard_tp.with_options(mesh=Mesh(2))])
    with pytest.raises(dcpgraph.VerificationError, match="shard_tp applied twice"):
        run_passes(sharded[2], [shard_tp.with_options(mesh=Mesh(2))])
