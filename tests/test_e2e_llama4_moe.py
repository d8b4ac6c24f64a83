"""Llama-4 text with its default MoE layers (every layer: a router whose top-k sigmoid scores
scale every token into every expert, plus a shared expert). HF's expert batch views raise a
contiguity guard ``torch.export`` cannot prove for a symbolic token count; while exporting,
dcpgraph runs the same arithmetic as a broadcast (:mod:`dcpgraph.frontends.score_scaled_experts`).
A tiny random fp64 model gives HF ``generate``'s greedy tokens at tp1 and at tp4·dcp2 (emulated
ranks), with the experts tensor-parallel and their all-reduce merged with the shared expert's."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import dcpgraph  # noqa: E402
from dcpgraph.frontends.score_scaled_experts import (  # noqa: E402
    is_score_scaled_moe,
    traceable_score_scaled_experts,
)
from dcpgraph.testing.generation import drain, hf_greedy  # noqa: E402

PROMPT = (5, 9, 4, 77, 10, 11, 3, 40, 41, 42, 8)  # crosses chunk starts and the 8-token prefill chunk
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def model():
    import transformers

    config = transformers.Llama4TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=32, intermediate_size_mlp=96, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, head_dim=8, attention_chunk_size=4, num_local_experts=4,
        max_position_embeddings=128, initializer_range=0.2, tie_word_embeddings=False,
        pad_token_id=0, bos_token_id=1, eos_token_id=None,
    )
    assert config.moe_layers == [0, 1]  # the default: every layer is a MoE layer
    torch.manual_seed(0)
    return transformers.Llama4ForCausalLM(config).to(torch.float64).eval()


@pytest.fixture(scope="module")
def program(model):
    return dcpgraph.trace(model)


def test_the_broadcast_form_is_the_blocks_own_function(model):
    block = model.model.layers[0].feed_forward
    assert is_score_scaled_moe(block) and not is_score_scaled_moe(model.model.layers[0].self_attn)
    x = torch.randn(1, 5, 64, dtype=torch.float64)
    want, want_logits = block(x)
    with traceable_score_scaled_experts(model) as count:
        got, got_logits = block(x)
    assert count == 2
    assert torch.equal(got, want.reshape(got.shape)) and torch.equal(got_logits, want_logits)
    assert "forward" not in vars(block) and "forward" not in vars(block.experts)  # restored


@pytest.mark.parametrize("tp, dcp", [(1, 1), (4, 2)])
def test_greedy_tokens_match_hf(model, program, tp, dcp):
    engine = dcpgraph.compile(program, tp=tp, dcp=dcp, block_size=4, max_num_batched_tokens=8)
    engine.add_request(list(PROMPT), max_new_tokens=NEW_TOKENS)
    assert drain(engine)[0] == hf_greedy(model, PROMPT, NEW_TOKENS)
    if tp > 1:
        summary = next(p.summary for p in engine.program.provenance if p.name == "shard_tp")
        assert "2 moe_tp_experts" in summary and "2 packed_rowwise" in summary
