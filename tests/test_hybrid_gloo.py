"""A hybrid (qwen3_next: three gated delta nets split over TP, one attention layer whose KV is
sharded over DCP) served by ``LLM`` at tp=2·dcp=2 from a saved checkpoint, as its worker processes
run it (17-50 s): the tokens must equal HF transformers' greedy ``generate`` on the same weights.
Every hybrid on two gloo ranks driven in process: tests/test_hybrid_acceptance.py."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gloo


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
