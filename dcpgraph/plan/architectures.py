"""Named architectures: the fields of each model's published HF ``config.json`` that the planner
reads (no weights, nothing downloaded). ``NAME:key=value,...`` overrides keys, e.g.
``deepseek-v3:num_hidden_layers=4``.

Sources: the ``config.json`` files of moonshotai/Kimi-K2-Instruct, deepseek-ai/DeepSeek-V3,
deepseek-ai/DeepSeek-V3.2-Exp, Qwen/Qwen3-235B-A22B and meta-llama/Llama-3.1-70B on the
Hugging Face hub; ``deepseek-v4-flash`` is transformers' ``DeepseekV4Config()`` defaults, which
its docstring ties to deepseek-ai/DeepSeek-V4-Flash-Base (``layer_types`` left out: HF's default
schedule, two HCA layers then CSA and HCA alternating, 20 CSA and 23 HCA of 43).
"""

from __future__ import annotations

_DEEPSEEK_V3 = {
    "model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
    "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256, "num_experts_per_tok": 8,
    "first_k_dense_replace": 3, "moe_layer_freq": 1, "q_lora_rank": 1536, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "max_position_embeddings": 163840, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}

ARCHITECTURES: dict[str, dict] = {
    "deepseek-v3": _DEEPSEEK_V3,
    "kimi-k2": {
        **_DEEPSEEK_V3, "model_type": "kimi_k2", "vocab_size": 163840, "num_attention_heads": 64,
        "num_key_value_heads": 64, "n_routed_experts": 384, "first_k_dense_replace": 1,
        "max_position_embeddings": 131072,
    },
    # DeepSeek Sparse Attention: a lightning indexer (64 heads of 128) scores every cached token
    # and attention reads only the top 2048 of them.
    "deepseek-v3.2": {
        **_DEEPSEEK_V3, "model_type": "deepseek_v32", "index_n_heads": 64, "index_head_dim": 128,
        "index_topk": 2048,
    },
    # DeepSeek-V4: compressed attention (a 128-token raw window, CSA entries of 4 tokens with a
    # lightning indexer keeping 512, HCA entries of 128 tokens) over one 512-wide K=V head.
    "deepseek-v4-flash": {
        "model_type": "deepseek_v4", "vocab_size": 129280, "hidden_size": 4096, "moe_intermediate_size": 2048,
        "num_hidden_layers": 43, "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512,
        "q_lora_rank": 1024, "num_experts_per_tok": 6, "n_routed_experts": 256, "n_shared_experts": 1,
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
        "hc_mult": 4, "sliding_window": 128, "o_groups": 8, "o_lora_rank": 1024, "index_n_heads": 64,
        "index_head_dim": 128, "index_topk": 512, "max_position_embeddings": 1048576,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    },
    "qwen3-235b-a22b": {
        "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
        "moe_intermediate_size": 1536, "num_hidden_layers": 94, "num_attention_heads": 64,
        "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "max_position_embeddings": 40960,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    },
    "llama-3.1-70b": {
        "model_type": "llama", "vocab_size": 128256, "hidden_size": 8192, "intermediate_size": 28672,
        "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
        "max_position_embeddings": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    },
}


def _value(text: str):
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text.strip()


def named_config(spec: str) -> dict:
    """The config dict of ``NAME`` or ``NAME:key=value,...``; ValueError names the choices."""
    name, _, overrides = spec.partition(":")
    key = name.strip().lower()
    if key not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {name!r}: give a local HF model directory or one of "
                         f"{sorted(ARCHITECTURES)} (optionally NAME:key=value,...)")
    config = dict(ARCHITECTURES[key], name=key)
    for item in filter(None, (s.strip() for s in overrides.split(","))):
        k, eq, v = item.partition("=")
        if not eq:
            raise ValueError(f"override {item!r} in {spec!r} is not key=value")
        config[k.strip()] = _value(v)
    return config
