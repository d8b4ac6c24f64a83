"""Kimi delta attention hybrids (kimi_linear, bailing_hybrid) on TP and DCP meshes, emulated
executor: the KDA layers' heads split over TP by ``shard_recurrent_tp`` (state pools 1/tp per
rank, ``o_proj`` row-parallel), the MLA layers' latent KV sharded over DCP, the recurrent ops
reading the request's global context length. The traced programs give HF's logits over a
whole prompt (canonical ``causal_conv1d`` + ``kimi_delta_rule`` per KDA layer).

Exactness is against HF transformers' own greedy ``generate`` on the same weights: prompts
longer than the prefill chunk (8 tokens), a KV cache small enough to preempt at dcp <= 2 (the
preempted request restarts its state in a fresh slot)."""

import pytest
import torch

import dcpgraph
from dcpgraph.passes.tp_styles import SectionShardRule
from dcpgraph.program import REPLICATE, ShardRule
from dcpgraph.recurrent_state import KimiDeltaShape

transformers = pytest.importorskip("transformers")

from hybrid_mesh_checks import count, forward, recurrent_tp_summary, run_on_mesh, shard_rules  # noqa: E402
from hybrid_models import KDA_MESH_MODELS, kimi_linear  # noqa: E402

DCP = torch.ops.dcpgraph

SHAPE = KimiDeltaShape(4, 8, 4)  # the KDA_MESH_MODELS' three KDA layers: 4 heads of 8, conv kernel 4
KDA_LAYERS = (0, 1, 3)


@pytest.fixture(scope="module", params=["kimi_linear", pytest.param("bailing_hybrid", marks=pytest.mark.slow)])
def traced(request):
    model = KDA_MESH_MODELS[request.param]()
    return request.param, model, dcpgraph.trace(model)


def test_kda_hybrid_traces_to_canonical_ops_with_hf_logits(traced):
    _, model, program = traced
    assert program.facts.extra["recurrent_layers"] == dict.fromkeys(KDA_LAYERS, "kimi delta attention")
    assert program.facts.attention == "mla"
    assert count(program, DCP.kimi_delta_rule.default) == count(program, DCP.causal_conv1d.default) == 3
    assert count(program, DCP.attention.default) == 1
    ids = torch.randint(0, 64, (1, 19), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    torch.testing.assert_close(forward(program, ids), ref, atol=1e-4, rtol=1e-4)


def test_kda_hybrid_at_tp2_dcp2_gives_hf_tokens_with_heads_and_state_split(traced):
    arch, model, program = traced
    engine = run_on_mesh(model, program, 2, 2)
    compiled = engine.program
    local = SHAPE.on_rank(2)
    assert {(p.name, p.shape) for p in compiled.recurrent_states} == {
        *((f"conv_state_{i}", local.conv_state_shape(1)[1:]) for i in KDA_LAYERS),
        *((f"recurrent_state_{i}", local.recurrent_state_shape(1)[1:]) for i in KDA_LAYERS)}
    rules = shard_rules(compiled)
    prefix = "model.layers.0.self_attn."
    assert rules[prefix + "conv1d.weight"] == SectionShardRule(0, sections=(32, 32, 32))
    assert rules[prefix + "o_proj.weight"] == ShardRule(1) and rules[prefix + "q_proj.weight"] == ShardRule(0)
    assert rules[prefix + "forget_gate.A_log"] == ShardRule(2 if arch == "kimi_linear" else 0)  # its head axis
    assert rules[prefix + "o_norm.weight"] == REPLICATE
    if arch == "kimi_linear":  # the low-rank gates' down projections stay whole
        assert rules[prefix + "forget_gate.f_a_proj.weight"] == REPLICATE == rules[prefix + "g_a_proj.weight"]
    report = engine.memory_report()
    assert report["recurrent_state_bytes_per_request"] == 3 * SHAPE.state_bytes_per_request(torch.float32, tp=2)
    assert 2 * report["recurrent_state_bytes_per_request"] == 3 * SHAPE.state_bytes_per_request(torch.float32)
    summary = recurrent_tp_summary(compiled)
    assert "split by heads/channels" in summary and "replicated" not in summary


@pytest.mark.slow  # 10-40 s a case by load (verified compile, HF generate, ~20 engine steps)
@pytest.mark.parametrize("tp, dcp", [(1, 1), (4, 2), (4, 4)])
def test_kda_hybrid_gives_hf_greedy_tokens_on_meshes(traced, tp, dcp):
    _, model, program = traced
    run_on_mesh(model, program, tp, dcp)


@pytest.mark.slow  # ~30 s: its own trace, a verified compile, HF generate
def test_kda_layers_tp_does_not_divide_are_replicated():
    model = kimi_linear(kda_heads=2)  # 2 KDA heads: tp=4 replicates them beside the split MLA
    engine = run_on_mesh(model, dcpgraph.trace(model), 4, 2)
    assert "layers [0, 1, 3] replicated" in recurrent_tp_summary(engine.program)
    full = 3 * KimiDeltaShape(2, 8, 4).state_bytes_per_request(torch.float32)
    assert engine.memory_report()["recurrent_state_bytes_per_request"] == full
