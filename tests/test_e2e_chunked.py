"""Chunked (block-local) attention, Llama-4 text's ``chunked_attention`` layers: a query at
position ``p`` sees only keys of its own chunk, ``⌊p/C⌋·C <= j <= p``. A tiny random
``llama4_text`` (chunked and full layers, NoPE layer, temperature tuning) gives HF ``generate``'s
greedy tokens for prompts that cross chunk boundaries, at tp1 and on a DCP mesh (emulated ranks),
where each rank bounds its shard by the chunk start as it does a sliding window's start."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import dcpgraph  # noqa: E402
from dcpgraph.errors import UnsupportedModelError  # noqa: E402
from dcpgraph.testing.generation import drain, hf_greedy  # noqa: E402

CHUNK = 4
PROMPTS = ((5, 9, 4, 77, 10, 11, 3, 40, 41, 42, 8), (7, 3))  # crosses two chunk starts / one after decode
NEW_TOKENS = 8


def build(chunk: int = CHUNK) -> torch.nn.Module:
    import transformers

    config = transformers.Llama4TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, intermediate_size_mlp=96, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, head_dim=8, attention_chunk_size=chunk, moe_layers=[],
        max_position_embeddings=128, initializer_range=0.2, tie_word_embeddings=False,
        pad_token_id=0, bos_token_id=1, eos_token_id=None,
    )
    torch.manual_seed(0)
    return transformers.Llama4ForCausalLM(config).to(torch.float64).eval()


@pytest.fixture(scope="module")
def model():
    return build()


@pytest.fixture(scope="module")
def program(model):
    return dcpgraph.trace(model)


def greedy(program, prompt, tp: int, dcp: int, **kw) -> list[int]:
    engine = dcpgraph.compile(program, tp=tp, dcp=dcp, block_size=4, max_num_batched_tokens=8, **kw)
    engine.add_request(list(prompt), max_new_tokens=NEW_TOKENS)
    return drain(engine)[0]


def test_the_model_has_chunked_layers_that_change_its_tokens(model, program):
    assert "chunked_attention" in model.config.layer_types and "full_attention" in model.config.layer_types
    chunks = [n.args[8] for n in program.graph_module.graph.nodes
              if n.target is torch.ops.dcpgraph.attention.default and len(n.args) > 8]
    assert chunks == [CHUNK] * model.config.layer_types.count("chunked_attention")
    unchunked = build(chunk=64)  # same weights, every chunk longer than the sequence
    assert hf_greedy(unchunked, PROMPTS[0], NEW_TOKENS) != hf_greedy(model, PROMPTS[0], NEW_TOKENS)


@pytest.mark.parametrize("tp, dcp", [(1, 1), (4, 2)])
def test_greedy_tokens_match_hf(model, program, tp, dcp):
    for prompt in PROMPTS:
        assert greedy(program, prompt, tp, dcp) == hf_greedy(model, prompt, NEW_TOKENS), prompt


def test_the_context_new_split_is_refused_for_chunked_layers(program):
    from dcpgraph.passes.fuse_new_tokens import fuse_new_tokens
    from dcpgraph.passes.insert_kv_cache import insert_kv_cache
    from dcpgraph.passes.manager import run_passes

    cached = run_passes(program, [insert_kv_cache.with_options(block_size=4)])
    assert run_passes(cached, [fuse_new_tokens]).lowering.new_tokens == "fused"
    with pytest.raises(UnsupportedModelError, match=r"chunked \(block-local\) attention \(chunk 4\)"):
        run_passes(cached, [fuse_new_tokens.with_options(enabled=False)])
