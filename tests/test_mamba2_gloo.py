"""A Mamba-2 hybrid (bamba: two mixers split over TP by heads and B/C groups, one attention layer
whose KV is sharded over DCP) on the distributed executor, as ``LLM``/``serve`` run it at tp > 1:
two real gloo ranks at tp=2·dcp=2, rank 0 drives, rank 1 follows, each rank holding its own conv
and SSM pools for its half of the heads. The tokens must equal HF transformers' greedy
``generate`` on the same weights, through prefill chunks and a preemption."""

from __future__ import annotations

import pytest

from dcpgraph.runtime.distributed import spawn

pytestmark = pytest.mark.gloo
@pytest.mark.slow  # two gloo ranks tracing and compiling a hybrid on 2 shared cores
def test_mamba2_hybrid_on_gloo_ranks_gives_hf_greedy_tokens():
    from hybrid_models import MAMBA2_MESH_MODELS, NEW_TOKENS, PROMPTS, drive_on_gloo

    from dcpgraph.recurrent_state import Mamba2Shape
    from dcpgraph.testing.generation import hf_greedy

    results = spawn(drive_on_gloo, 2, "MAMBA2_MESH_MODELS", "bamba", timeout_s=300)
    model = MAMBA2_MESH_MODELS["bamba"]()
    assert results[0]["tokens"] == [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]
    assert results[0]["executor"] == "driver" and results[0]["preemptions"] >= 1
    local = Mamba2Shape(8, 8, 4, 8, 4).on_rank(2)
    assert results[0]["pools"] == results[1]["pools"]
    assert results[0]["pools"]["conv_state_0"] == local.conv_state_shape(1)[1:]
    assert results[0]["pools"]["ssm_state_2"] == local.ssm_state_shape(1)[1:]
