"""The language model of a composite (vision-language) checkpoint: a tiny random Gemma-3
``Gemma3ForConditionalGeneration`` saved by HF's ``save_pretrained`` is served text-only from its
directory (weights under the language model's prefix, the vision tower never read), with HF's own
VL model generating from the same text-only input as the reference."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import dcpgraph  # noqa: E402
from dcpgraph import UnsupportedModelError  # noqa: E402
from dcpgraph.checkpoints.composite import LanguageModelFiles, text_config_of  # noqa: E402
from dcpgraph.checkpoints.files import weight_files  # noqa: E402
from dcpgraph.checkpoints.loader import load_program  # noqa: E402
from dcpgraph.checkpoints.tensor_sources import SafetensorsFiles  # noqa: E402
from dcpgraph.frontends.layer_kinds import check_layer_types  # noqa: E402
from dcpgraph.testing.checkpoints import first_special_id, tiny_tokenizer  # noqa: E402
from dcpgraph.testing.generation import drain, hf_greedy  # noqa: E402

VOCAB = 321
PROMPT = [72, 101, 108, 108, 111, 32, 119, 111, 114]  # crosses the 4-token sliding window and blocks
NEW_TOKENS = 8
SEED = 0


def gemma3_vl(path) -> torch.nn.Module:
    import transformers

    special = first_special_id(VOCAB)
    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
                num_key_value_heads=2, head_dim=8, max_position_embeddings=128, sliding_window=4,
                bos_token_id=special, eos_token_id=special + 2, pad_token_id=special)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  image_size=28, patch_size=14)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                       boi_token_index=VOCAB - 3, eoi_token_index=VOCAB - 2,
                                       image_token_index=VOCAB - 1)
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).to(torch.float64).eval()
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():  # scales at which greedy tokens vary (Gemma scales embeddings by sqrt(hidden))
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * (0.3 if "norm" in name else 0.05))
    model.save_pretrained(path)
    tiny_tokenizer(VOCAB).save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("gemma3_vl"))
    model = gemma3_vl(path)
    return path, hf_greedy(model, PROMPT, NEW_TOKENS)


def test_only_the_language_models_tensors_are_seen_under_the_text_models_names(checkpoint):
    path, _ = checkpoint
    stored = SafetensorsFiles(path, weight_files(path))
    assert any("vision_tower" in n for n in stored.names())
    seen = LanguageModelFiles(stored)
    assert "model.embed_tokens.weight" in seen and "model.layers.1.self_attn.k_proj.weight" in seen
    assert not any("vision" in n or "projector" in n for n in seen.names())
    assert seen.stored_name("model.norm.weight").endswith("language_model.model.norm.weight") or \
        seen.stored_name("model.norm.weight") == "model.language_model.norm.weight"


@pytest.mark.parametrize("tp, dcp", [(1, 1), (4, 2)])
def test_the_text_model_loaded_from_the_vl_checkpoint_matches_hfs_vl_model(checkpoint, tp, dcp):
    path, want = checkpoint
    assert len(set(want)) > 2, want  # not a degenerate reference
    program = load_program(path, "float64")
    assert program.facts.architecture == "Gemma3ForCausalLM"
    assert not any("vision" in target for target in program.state)
    engine = dcpgraph.compile(program, tp=tp, dcp=dcp, block_size=4, max_num_batched_tokens=8)
    engine.add_request(PROMPT, max_new_tokens=NEW_TOKENS)
    assert drain(engine)[0] == want


def test_llm_serves_the_vl_checkpoints_text_model(checkpoint):
    path, want = checkpoint
    llm = dcpgraph.LLM(model=path, dtype="float64", block_size=4)
    try:
        out = llm.generate([{"prompt_token_ids": PROMPT}], dcpgraph.SamplingParams(temperature=0, max_tokens=NEW_TOKENS))
        assert list(out[0].outputs[0].token_ids) == want
    finally:
        llm.shutdown()


def test_recurrent_text_layers_of_a_composite_config_are_refused_by_name():
    import transformers

    text = text_config_of(transformers.Qwen3_5Config())
    assert text is not None and text.model_type == "qwen3_5_text"
    with pytest.raises(UnsupportedModelError, match="recurrent layers"):
        check_layer_types(text)
    assert text_config_of(transformers.LlamaConfig()) is None  # a plain causal LM config stays as it is


@pytest.mark.slow
def test_dcpgraph_serve_answers_text_from_the_vl_checkpoint_and_refuses_images(checkpoint, tmp_path):
    """``dcpgraph serve`` on the VL directory (a server process, so slow tier): a greedy completion
    of the token-id prompt is the text of HF's VL model's tokens; a chat message with an image part
    is a 400 naming the part type, and the server keeps answering."""
    import openai

    from dcpgraph.testing.server import running_server

    path, want = checkpoint
    with running_server(path, "--dtype", "float64", "--block-size", "4", "--served-model-name", "vl",
                        log_path=str(tmp_path / "server.log")) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
        out = client.completions.create(model="vl", prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0)
        assert out.choices[0].text == tiny_tokenizer(VOCAB).decode(want, skip_special_tokens=True)
        assert out.usage.completion_tokens == len(want)
        image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
        with pytest.raises(openai.BadRequestError, match=r"content part type 'image_url' is not supported"):
            client.chat.completions.create(model="vl", max_tokens=2, messages=[
                {"role": "user", "content": [{"type": "text", "text": "what is this?"}, image]}])
        assert client.completions.create(model="vl", prompt=PROMPT, max_tokens=1, temperature=0).choices[0].text
