"""The tiny GQA models the PCP tests run, eager and compiled: Llama with one KV head and Qwen3
with two (so some meshes shard a KV head's cache over PCP ranks and some are refused), fp64,
built once per process. Their vocabulary (131) divides by no tp > 1, as real checkpoints' often
do not; prompts draw ids below 128."""

from __future__ import annotations

import torch
import transformers as tf


def pcp_config(cls, kv: int):
    """The PCP test models' shape for config class ``cls`` with ``kv`` KV heads."""
    return cls(vocab_size=131, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
               num_key_value_heads=kv, head_dim=8, max_position_embeddings=256, initializer_range=0.2)


_MODELS: dict[str, torch.nn.Module] = {}


def pcp_model(name: str) -> torch.nn.Module:
    """``"llama"`` (1 KV head) or ``"qwen3"`` (2 KV heads), seeded, shared by the tests of a process."""
    if name not in _MODELS:
        torch.manual_seed(7)
        cls, cfg = {"llama": (tf.LlamaForCausalLM, pcp_config(tf.LlamaConfig, kv=1)),
                    "qwen3": (tf.Qwen3ForCausalLM, pcp_config(tf.Qwen3Config, kv=2))}[name]
        _MODELS[name] = cls(cfg).to(torch.float64).eval()
    return _MODELS[name]


def matches_hf(model, prompt, tokens) -> bool:
    """HF greedy gives ``tokens`` (it stops after an EOS, so a shorter answer must be a prefix)."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=len(tokens), do_sample=False)
    ref = out[0, len(prompt):].tolist()
    return len(ref) >= 1 and tokens[:len(ref)] == ref
