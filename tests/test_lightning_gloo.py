"""MiniMax (two lightning-attention layers split over TP by heads, two full-attention layers whose
KV is sharded over DCP, a sparse MoE) on the distributed executor, as ``LLM``/``serve`` run it at
tp > 1: two real gloo ranks at tp=2·dcp=2, rank 0 drives, rank 1 follows, each rank holding the kv
state of its half of the heads and all-reducing the output norm's mean. The tokens must equal HF
transformers' greedy ``generate`` on the same weights, through prefill chunks and a preemption."""

from __future__ import annotations

import pytest

from dcpgraph.runtime.distributed import spawn

pytestmark = pytest.mark.gloo


@pytest.mark.slow  # two gloo ranks tracing and compiling a hybrid on 2 shared cores
def test_minimax_on_gloo_ranks_gives_hf_greedy_tokens():
    from hybrid_models import LIGHTNING_MESH_MODELS, NEW_TOKENS, PROMPTS, drive_on_gloo

    from dcpgraph.recurrent_state import LightningAttentionShape
    from dcpgraph.testing.generation import hf_greedy

    results = spawn(drive_on_gloo, 2, "LIGHTNING_MESH_MODELS", "minimax", timeout_s=300)
    model = LIGHTNING_MESH_MODELS["minimax"]()
    assert results[0]["tokens"] == [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]
    assert results[0]["executor"] == "driver" and results[0]["preemptions"] >= 1
    local = LightningAttentionShape(4, 8).on_rank(2)
    assert results[0]["pools"] == results[1]["pools"] == {
        f"kv_state_{i}": local.kv_state_shape(1)[1:] for i in (0, 2)}
