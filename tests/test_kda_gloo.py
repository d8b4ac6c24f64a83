"""A Kimi delta attention hybrid (kimi_linear: three KDA layers split over TP by heads, one MLA
layer whose latent KV is sharded over DCP) on the distributed executor, as ``LLM``/``serve`` run
it at tp > 1: two real gloo ranks at tp=2·dcp=2, rank 0 drives, rank 1 follows, each rank holding
its own conv and recurrent pools for its half of the heads. The tokens must equal HF
transformers' greedy ``generate`` on the same weights, through prefill chunks and a preemption."""

from __future__ import annotations

import pytest

from dcpgraph.runtime.distributed import spawn

pytestmark = pytest.mark.gloo


@pytest.mark.slow  # two gloo ranks tracing and compiling a hybrid on 2 shared cores
def test_kda_hybrid_on_gloo_ranks_gives_hf_greedy_tokens():
    from hybrid_models import KDA_MESH_MODELS, NEW_TOKENS, PROMPTS, drive_on_gloo

    from dcpgraph.recurrent_state import KimiDeltaShape
    from dcpgraph.testing.generation import hf_greedy

    results = spawn(drive_on_gloo, 2, "KDA_MESH_MODELS", "kimi_linear", timeout_s=300)
    model = KDA_MESH_MODELS["kimi_linear"]()
    assert results[0]["tokens"] == [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]
    assert results[0]["executor"] == "driver" and results[0]["preemptions"] >= 1
    local = KimiDeltaShape(4, 8, 4).on_rank(2)
    assert results[0]["pools"] == results[1]["pools"]
    assert results[0]["pools"]["conv_state_0"] == local.conv_state_shape(1)[1:]
    assert results[0]["pools"]["recurrent_state_3"] == local.recurrent_state_shape(1)[1:]
