"""The GQA end-to-end suite's models and run settings, shared by the tests that reuse them.

Tiny Llama (1 KV head), Qwen3 (q/k RMSNorm, 2 KV heads) and Qwen2 (q/k/v bias, 1 KV head), 8 query
heads, 2 layers, hidden 64, vocab 128, random fp64 weights with a large ``initializer_range``; the
biases and norm weights HF leaves at 0 and 1 are redrawn so those paths are not vacuous.
"""

from __future__ import annotations

import torch

from dcpgraph.testing.generation import hf_greedy

__all__ = ["BLOCK_SIZE", "COMMON", "COMMS", "EOS", "EXPECTED_VALID", "INTERLEAVES", "MAX_BATCHED", "MAX_NEW",
           "MODELS", "PROMPTS", "SEEDS", "VOCAB", "build_model", "hf_greedy"]

# -- models -------------------------------------------------------------------------------------
VOCAB = 128
EOS = 2
COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=8, max_position_embeddings=256, initializer_range=0.2,
    tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=EOS,
)
MODELS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=1)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(num_key_value_heads=2, head_dim=8)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_key_value_heads=1)),
}
# Seeds picked for varied greedy outputs; qwen3's stops at EOS after 23 tokens on the 1-token prompt.
SEEDS = {"llama": 0, "qwen3": 4, "qwen2": 0}
EXPECTED_VALID = {
    "llama": [(1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (4, 4)],
    "qwen3": [(1, 1), (2, 1), (4, 1), (4, 2)],
    "qwen2": [(1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (4, 4)],
}

# -- run settings -------------------------------------------------------------------------------
BLOCK_SIZE = 4
INTERLEAVES = (1, 2, BLOCK_SIZE)
COMMS = ("a2a", "ag_rs")
MAX_BATCHED = 8
MAX_NEW = 24
PROMPTS = (
    (5,),
    (9, 4, 77),
    tuple(range(10, 17)),
    tuple((7 * i + 3) % VOCAB for i in range(13)),
    tuple((11 * i + 5) % VOCAB for i in range(21)),
)
assert all(EOS not in p for p in PROMPTS)


def build_model(name: str, seed: int | None = None) -> torch.nn.Module:
    """The fp64 model ``name`` with seeded random weights (biases and norm weights redrawn)."""
    import transformers

    seed = SEEDS[name] if seed is None else seed
    config_cls, model_cls, extra = MODELS[name]
    config = getattr(transformers, config_cls)(**COMMON, **extra)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).to(torch.float64).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.normal_(1.0, 0.3)
            elif pname.endswith("bias"):
                p.normal_(0.0, 0.3)
    return model
