"""Small models from real transformers architectures, built locally with random weights.

Nothing is downloaded: the config is written here and the weights come from a seeded
initialisation, so every process that builds ``build_model("qwen3", seed=0)`` gets the same model.
The shapes are chosen so that the interesting meshes are valid: GQA models have one KV head (so
tp=2 and tp=4 replicate it and dcp can remove the copies), MLA models have one latent head anyway.
"""

from __future__ import annotations

import os

import torch

ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v2", "deepseek_v3")


def tiny_config(arch: str, *, layers: int = 2, vocab: int = 256):
    import transformers as tf

    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=8, max_position_embeddings=2048, tie_word_embeddings=False)
    if arch == "llama":
        return tf.LlamaConfig(num_key_value_heads=1, **common)
    if arch == "qwen2":
        return tf.Qwen2Config(num_key_value_heads=1, **common)
    if arch == "qwen3":
        return tf.Qwen3Config(num_key_value_heads=1, head_dim=16, **common)
    if arch == "qwen3_moe":
        return tf.Qwen3MoeConfig(num_key_value_heads=1, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                 moe_intermediate_size=32, norm_topk_prob=True, **common)
    mla = dict(kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
               n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
               n_shared_experts=1, first_k_dense_replace=1, num_key_value_heads=8)
    if arch == "deepseek_v2":
        return tf.DeepseekV2Config(q_lora_rank=None, topk_method="greedy", **mla, **common)
    if arch == "deepseek_v3":
        return tf.DeepseekV3Config(q_lora_rank=24, n_group=1, topk_group=1, **mla, **common)
    raise ValueError(f"unknown architecture {arch!r}; choose from {ARCHITECTURES} or a local model directory")


def build_model(name: str, *, seed: int = 0, dtype: torch.dtype = torch.float64, layers: int = 2):
    """A causal LM: a local HF model directory, or one of :data:`ARCHITECTURES` (random weights)."""
    import transformers as tf

    if os.path.isdir(name):
        model = tf.AutoModelForCausalLM.from_pretrained(name, dtype=dtype)
        return model.eval()
    config = tiny_config(name, layers=layers)
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config).to(dtype).eval()
    return model
