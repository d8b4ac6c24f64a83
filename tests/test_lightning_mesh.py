"""MiniMax (lightning attention beside full attention, a sparse MoE, residual alpha/beta factors)
traced, compiled and served, emulated executor: ``shard_recurrent_tp`` splits each lightning layer
by heads (``qkv_proj``/``output_gate``/``norm``/``slope_rate`` rows, ``out_proj`` row-parallel,
the all-head output norm's mean of squares averaged over the group), kv-state pools ``1/tp`` per
rank, the full-attention layers' KV sharded over DCP.

Exactness is against HF transformers' own forward and greedy ``generate`` (fp32, the experts
implementation transformers defaults to) on the same weights, prompts longer than the prefill
chunk (8 tokens) and than HF's prefill block (4), a KV cache small enough to preempt."""

import pytest
import torch

import dcpgraph
from dcpgraph.passes.collectives import collective_group
from dcpgraph.program import ShardRule
from dcpgraph.recurrent_state import LightningAttentionShape
from dcpgraph.testing.generation import hf_greedy

transformers = pytest.importorskip("transformers")

from hybrid_mesh_checks import (  # noqa: E402
    count,
    forward,
    recurrent_tp_summary,
    run_on_mesh,
    shard_rules,
    users_within,
)
from hybrid_models import NEW_TOKENS, PROMPTS, minimax, run_through_preemption  # noqa: E402 - after the check

SHAPE = LightningAttentionShape(4, 8)  # the tiny model's lightning layers: 4 heads of 8
LIGHTNING_LAYERS = (0, 2)
# blocks of 4 per rank at dcp 2: the longest request fits alone, not all three; dcp 4: the default cache
PREEMPTING_BLOCKS = {2: 4}


@pytest.fixture(scope="module")
def traced():
    model = minimax()
    return model, dcpgraph.trace(model)


def test_trace_gives_hf_logits_and_names_the_lightning_layers(traced):
    model, program = traced
    assert program.facts.extra["recurrent_layers"] == {0: "lightning attention", 2: "lightning attention"}
    assert count(program, torch.ops.dcpgraph.lightning_attention.default) == 2
    assert count(program, torch.ops.dcpgraph.attention.default) == 2
    ids = torch.randint(0, 64, (1, 11), generator=torch.Generator().manual_seed(1))  # 3 of HF's prefill blocks
    with torch.no_grad():
        want = model(input_ids=ids).logits
    torch.testing.assert_close(forward(program, ids), want, atol=1e-4, rtol=1e-4)


@pytest.mark.slow  # ~10 s; the default tier's tp2·dcp2 run also goes through a preemption
def test_tp1_gives_hf_greedy_tokens_through_prefill_chunks_and_a_preemption(traced):
    model, program = traced
    engine = run_through_preemption(model, program)
    assert engine.memory_report()["recurrent_state_bytes_per_request"] == 2 * SHAPE.state_bytes_per_request(
        torch.float32)


def _check_split_over(compiled, tp: int) -> None:
    """Each lightning layer split by heads over ``tp``: its parameters' rules, ``1/tp`` kv-state
    pools, ``H/tp`` local heads reaching the op, and its output norm's mean all-reduced over TP."""
    rules = shard_rules(compiled)
    for layer in LIGHTNING_LAYERS:
        prefix = f"model.layers.{layer}.self_attn."
        assert all(rules[prefix + name] == ShardRule(0)
                   for name in ("qkv_proj.weight", "output_gate.weight", "norm.weight", "slope_rate"))
        assert rules[prefix + "out_proj.weight"] == ShardRule(1)
    local = SHAPE.on_rank(tp)
    assert {(p.name, p.role, p.shape) for p in compiled.recurrent_states} == {
        (f"kv_state_{i}", "kv_state", local.kv_state_shape(1)[1:]) for i in LIGHTNING_LAYERS}
    summary = recurrent_tp_summary(compiled)
    assert "layers [0, 2] split by heads/channels" in summary and "replicated" not in summary
    graph = compiled.graph_module.graph
    ops = [n for n in graph.nodes if n.target == torch.ops.dcpgraph.lightning_attention_.default]
    assert [tuple(n.args[0].meta["val"].shape[1:]) for n in ops] == [(SHAPE.heads // tp, 8)] * 2
    reduced_means = [n for n in graph.nodes if n.target is torch.ops.aten.mean.dim
                     and any((collective_group(u) or ("",))[0] == "tp" for u in users_within(n, 2))]
    assert len(reduced_means) == 2  # each lightning layer's output norm averages over the TP group


@pytest.mark.parametrize("tp, dcp", [
    (2, 2),
    pytest.param(4, 2, marks=pytest.mark.slow),  # ~30 s each on the shared cores
    pytest.param(4, 4, marks=pytest.mark.slow),
])
def test_minimax_gives_hf_greedy_tokens_on_meshes(traced, tp, dcp):
    model, program = traced
    engine = run_on_mesh(model, program, tp, dcp, blocks=PREEMPTING_BLOCKS)
    _check_split_over(engine.program, tp)
    report = engine.memory_report()
    assert report["recurrent_state_bytes_per_request"] == 2 * SHAPE.state_bytes_per_request(torch.float32, tp=tp)
    assert tp * report["recurrent_state_bytes_per_request"] == 2 * SHAPE.state_bytes_per_request(torch.float32)


@pytest.mark.slow  # a checkpoint written, loaded, and served by two worker processes (~60-200 s)
def test_minimax_checkpoint_served_by_llm_gives_hf_greedy_tokens(tmp_path):
    """From ``save_pretrained``'s files: each lightning layer's ``slope_rate`` (whose layer factor
    differs per layer) loads with HF's values, and ``LLM`` at tp=2·dcp=2 gives HF's tokens."""
    from dcpgraph import LLM, SamplingParams
    from dcpgraph.checkpoints.loader import load_program
    from dcpgraph.program import STATE_KINDS
    from dcpgraph.testing.checkpoints import tiny_tokenizer

    model = minimax()
    model.save_pretrained(tmp_path)
    tiny_tokenizer(model.config.vocab_size).save_pretrained(tmp_path)
    program = load_program(str(tmp_path), "float32")
    specs = [s for s in program.inputs if s.kind in STATE_KINDS]
    loaded = dict(zip((s.target for s in specs), program.local_state(0)))
    slopes = [f"model.layers.{i}.self_attn.slope_rate" for i in LIGHTNING_LAYERS]
    buffers = dict(model.named_buffers())
    assert all(torch.equal(loaded[name], buffers[name]) for name in slopes)
    assert not torch.equal(buffers[slopes[0]], buffers[slopes[1]])
    want = [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]
    with LLM(str(tmp_path), dtype="float32", max_model_len=64, tensor_parallel_size=2, decode_context_parallel_size=2,
             block_size=4, max_num_batched_tokens=8, worker_timeout_s=300) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(temperature=0, max_tokens=NEW_TOKENS))
        assert [list(o.outputs[0].token_ids) for o in outs] == want
        assert llm.engine.report()["executor"] == "driver"
