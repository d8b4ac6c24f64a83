"""Tiny seeded HF models with sliding windows, soft-capping and attention sinks, for end-to-end
tests (``test_e2e_sliding``, ``test_e2e_sliding_gloo``).

Every model has 2 or 3 layers, 8 query heads over 1 KV head (so every DCP size up to 4 is valid at
tp=4), random fp64 weights with a large ``initializer_range`` and a window of ``WINDOW`` = 5
tokens, shorter than most test prompts, and a vocabulary (131) no tp > 1 divides. :data:`FEATURES`
says what each exercises.
"""

from __future__ import annotations

import torch
import transformers

WINDOW = 5
# Run settings of the end-to-end suites: prompts longer than the window, a block shorter than it.
PROMPTS = ((5,), (9, 4, 77), (3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46), tuple(range(40, 61)))
MAX_NEW = 12
BLOCK = 4
COMMON = dict(
    vocab_size=131, hidden_size=64, intermediate_size=128, num_attention_heads=8, num_key_value_heads=1,
    max_position_embeddings=256, initializer_range=0.2, tie_word_embeddings=False,
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
)
MIXED = ["sliding_attention", "full_attention", "sliding_attention"]
MODELS = {
    # name: (config class, model class, config overrides)
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(num_hidden_layers=2, sliding_window=WINDOW)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        num_hidden_layers=2, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        num_hidden_layers=2, head_dim=8, sliding_window=WINDOW, attn_logit_softcapping=1.5,
        final_logit_softcapping=None, query_pre_attn_scalar=8)),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        num_hidden_layers=3, head_dim=8, sliding_window=WINDOW, layer_types=MIXED, query_pre_attn_scalar=8)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        num_hidden_layers=3, head_dim=8, use_sliding_window=True, sliding_window=WINDOW, layer_types=MIXED)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        num_hidden_layers=2, head_dim=8, sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2,
        layer_types=["sliding_attention", "full_attention"])),
}
FEATURES = {
    "mistral": "every layer sliding",
    "qwen2": "every layer sliding (use_sliding_window, max_window_layers=0)",
    "gemma2": "alternating sliding/full and logit soft-capping",
    "gemma3_text": "mixed sliding/full by layer_types",
    "qwen3": "mixed sliding/full by layer_types",
    "gpt_oss": "attention sinks, sliding/full layers, MoE experts",
}
SEEDS = {"mistral": 0, "qwen2": 0, "gemma2": 0, "gemma3_text": 0, "qwen3": 0, "gpt_oss": 0}

# GPT-OSS's own TP plan shards only the embedding; this one shards attention by heads, the sinks
# with them (one logit per query head), and leaves the experts replicated.
GPT_OSS_PLAN = {
    "model.layers.*.self_attn.q_proj": "colwise",
    "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise",
    "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.self_attn.sinks": "colwise",
}


def build(name: str) -> torch.nn.Module:
    config_cls, model_cls, overrides = MODELS[name]
    torch.manual_seed(SEEDS[name])
    config = getattr(transformers, config_cls)(**COMMON, **overrides)
    model = getattr(transformers, model_cls)(config).double().eval()
    if name == "gpt_oss":
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0.0, 1.5)  # HF initialises them to a constant
    return model


def compile_options(name: str, tp: int) -> dict:
    return {"plan": GPT_OSS_PLAN} if name == "gpt_oss" and tp > 1 else {}


def layer_kinds(model) -> list[str]:
    """Per layer: the window each attention module passes to HF's attention function (or 'full')."""
    kinds = []
    for layer in model.model.layers:
        attn = layer.self_attn
        window = attn.sliding_window if hasattr(attn, "sliding_window") else model.config.sliding_window
        kinds.append(f"sliding {window}" if window else "full")
    return kinds
