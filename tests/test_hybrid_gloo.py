"""A hybrid (qwen3_next: three gated delta nets split over TP, one attention layer whose KV is
sharded over DCP) on the distributed executor, as ``LLM``/``serve`` run it at tp > 1: two real
gloo ranks at tp=2·dcp=2, rank 0 drives (schedules, ships each step with its state slots), rank 1
follows; each rank holds its own state pools for its half of the heads. The tokens must equal HF
transformers' greedy ``generate`` on the same weights, through prefill chunks and a preemption.

One spawn of two ranks (25-75 s by load: each rank traces and compiles), and the same
mesh through `LLM` from a saved checkpoint (two worker processes, 17-50 s)."""

from __future__ import annotations

import pytest

from dcpgraph.runtime.distributed import spawn

pytestmark = pytest.mark.gloo
@pytest.mark.slow  # two gloo ranks tracing and compiling a hybrid on 2 shared cores
def test_hybrid_on_gloo_ranks_gives_hf_greedy_tokens():
    from hybrid_models import MESH_MODELS, NEW_TOKENS, PROMPTS, drive_on_gloo

    from dcpgraph.recurrent_state import GatedDeltaNetShape
    from dcpgraph.testing.generation import hf_greedy

    results = spawn(drive_on_gloo, 2, "MESH_MODELS", "qwen3_next", timeout_s=300)
    model = MESH_MODELS["qwen3_next"]()
    assert results[0]["tokens"] == [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]
    assert results[0]["executor"] == "driver" and results[0]["preemptions"] >= 1
    local = GatedDeltaNetShape(4, 8, 8, 8, 4).on_rank(2)
    assert results[0]["pools"] == results[1]["pools"]
    assert results[0]["pools"]["conv_state_0"] == local.conv_state_shape(1)[1:]
    assert results[0]["pools"]["recurrent_state_0"] == local.recurrent_state_shape(1)[1:]
    per_request = 3 * local.state_bytes_per_request(__import__("torch").float32)
    assert results[0]["memory"]["recurrent_state_bytes_per_rank"] == [4 * per_request] * 2


@pytest.mark.slow  # 17-50 s: two worker processes loading the checkpoint, tracing and compiling
def test_llm_workers_serve_a_hybrid_checkpoint_at_tp2_dcp2(tmp_path):
    """``LLM`` at tp=2·dcp=2 from a saved checkpoint: the loader reads each rank's sections of the
    fused conv/projection tensors (the section rule's rows), the two worker processes hold their
    halves of the state, and the tokens equal HF's."""
    from hybrid_models import MESH_MODELS, NEW_TOKENS, PROMPTS

    from dcpgraph import LLM
    from dcpgraph.testing.checkpoints import tiny_tokenizer
    from dcpgraph.testing.generation import hf_greedy

    model = MESH_MODELS["qwen3_next"]()
    model.save_pretrained(tmp_path)
    tiny_tokenizer(model.config.vocab_size).save_pretrained(tmp_path)
    want = [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]
    with LLM(model=str(tmp_path), dtype="float32", block_size=4, tensor_parallel_size=2,
             decode_context_parallel_size=2, max_num_batched_tokens=8, worker_timeout_s=300) as llm:
        assert llm.engine.generate(PROMPTS, NEW_TOKENS) == want
        assert llm.engine.report()["executor"] == "driver"
