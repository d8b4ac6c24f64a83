"""olmo_hybrid (three gated delta nets in OLMo-Hybrid's separate-projection layout, one attention
layer) traced, compiled and served, emulated executor: the gated delta nets split over TP by key
heads like qwen3_5's (``q/k/v/g/b/a_proj`` by rows, the conv by ``[q | k | v]`` section, ``o_proj``
row-parallel, ``o_norm`` replicated), state pools ``1/tp`` per rank, the attention KV sharded over
DCP. Exactness is against HF transformers' own forward and greedy ``generate`` (fp32) on the same
weights, prompts longer than the prefill chunk (8 tokens), a cache small enough to preempt."""

import pytest
import torch

import dcpgraph
from dcpgraph.passes.tp_styles import SectionShardRule
from dcpgraph.program import REPLICATE, ShardRule
from dcpgraph.recurrent_state import GatedDeltaNetShape

transformers = pytest.importorskip("transformers")

from hybrid_mesh_checks import count, forward, run_on_mesh, shard_rules  # noqa: E402
from hybrid_models import olmo_hybrid, run_through_preemption  # noqa: E402

SHAPE = GatedDeltaNetShape(4, 8, 8, 8, 4)  # each of the 3 gated delta nets
PREEMPTING_BLOCKS = {2: 4}  # at dcp 4 the default cache; no preemption asked for


@pytest.fixture(scope="module")
def traced():
    model = olmo_hybrid()
    return model, dcpgraph.trace(model)


@pytest.mark.slow  # ~20-60 s: the trace (its gated delta nets' layer checks run in test_gated_delta_layer)
def test_trace_gives_hf_logits(traced):
    model, program = traced
    assert program.facts.extra["recurrent_layers"] == {i: "gated delta net" for i in range(3)}
    assert count(program, torch.ops.dcpgraph.gated_delta_rule.default) == 3
    ids = torch.randint(0, 64, (1, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(input_ids=ids).logits
    torch.testing.assert_close(forward(program, ids), want, atol=1e-4, rtol=1e-4)


@pytest.mark.slow  # ~25 s on the shared cores: a verified compile, HF generate, ~20 steps
def test_tp1_gives_hf_greedy_tokens_through_prefill_chunks_and_a_preemption(traced):
    model, program = traced
    engine = run_through_preemption(model, program)
    assert engine.memory_report()["recurrent_state_bytes_per_request"] == 3 * SHAPE.state_bytes_per_request(
        torch.float32)


@pytest.mark.slow  # ~30-60 s a case on the shared cores
@pytest.mark.parametrize("tp, dcp", [(2, 2), (4, 2), (4, 4)])
def test_olmo_hybrid_gives_hf_greedy_tokens_on_meshes(traced, tp, dcp):
    model, program = traced
    engine = run_on_mesh(model, program, tp, dcp, blocks=PREEMPTING_BLOCKS)
    rules = shard_rules(engine.program)
    prefix = "model.layers.0.linear_attn."
    assert all(rules[f"{prefix}{name}_proj.weight"] == ShardRule(0) for name in "qkvgba")
    assert rules[prefix + "conv1d.weight"] == SectionShardRule(0, sections=(32, 32, 64))
    assert rules[prefix + "o_proj.weight"] == ShardRule(1) and rules[prefix + "o_norm.weight"] == REPLICATE
    assert engine.memory_report()["recurrent_state_bytes_per_request"] == 3 * SHAPE.state_bytes_per_request(
        torch.float32, tp=tp)
