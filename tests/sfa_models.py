"""Tiny seeded DeepSeek sparse-attention (DSA) models for the SFA tests (``test_sparse_*``,
``test_e2e_sfa*``).

``deepseek_v32`` (DeepSeek-V3.2) and ``glm_moe_dsa`` (GLM-5): 2 layers (layer 0 dense, layer 1
MoE), 8 query heads, MLA latent 32 + rope 8, an indexer of ``INDEX_HEADS`` heads of dim 16 keeping
``TOPK`` = 4 tokens, shorter than most test prompts (1, 3, 6, 19 tokens plus the generated ones),
so the selection decides what every later query attends to. fp64 weights redrawn from N(0, 0.2)
(norms N(1, 0.3)), as in ``test_e2e_mla``, so attention and the indexer are far from uniform.

Ties: the indexer's score of a key is exactly 0 when every head's ReLU is 0; torch's ``topk``
orders such ties arbitrarily, dcpgraph by position, so HF and dcpgraph could select differently
when such a tie straddles the k-th place. With ``INDEX_HEADS`` = 8 an all-zero key has probability
about 2⁻⁸ per (query, key); the comparisons with HF are exact on these seeds (a flip would fail them,
it would not be hidden), and the tie rule itself is tested against a dense reference in
``test_sparse_ops``.
"""

from __future__ import annotations

import torch
import transformers

VOCAB = 256
LAYERS = 2
HEADS = 8
KV_LORA_RANK, ROPE, NOPE, V_DIM = 32, 8, 16, 16
INDEX_HEADS, INDEX_DIM, TOPK = 8, 16, 4
PROMPTS = ((7,), (9, 4, 77), tuple(range(10, 16)), tuple((7 * i + 3) % VOCAB for i in range(19)))


def config(name: str = "deepseek_v32", *, topk: int = TOPK, layers: int = LAYERS, **overrides):
    common = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=HEADS, num_key_value_heads=HEADS, max_position_embeddings=2048,
        tie_word_embeddings=False, kv_lora_rank=KV_LORA_RANK, qk_rope_head_dim=ROPE, qk_nope_head_dim=NOPE,
        v_head_dim=V_DIM, q_lora_rank=24, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
        index_topk=topk, index_head_dim=INDEX_DIM, index_n_heads=INDEX_HEADS,
    )
    common.update(overrides)
    if name == "deepseek_v32":
        return transformers.DeepseekV32Config(**common)
    if name == "glm_moe_dsa":
        return transformers.GlmMoeDsaConfig(**common)
    raise ValueError(f"unknown DSA model {name!r}; known: deepseek_v32, glm_moe_dsa")


def build(name: str = "deepseek_v32", *, seed: int = 1, **config_overrides) -> torch.nn.Module:
    """The seeded fp64 model (eager experts for HF's own generate)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config(name, **config_overrides)).to(torch.float64).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            mean, std = (1.0, 0.3) if "norm" in pname else (0.0, 0.2)
            p.copy_(mean + std * torch.randn(p.shape, generator=gen, dtype=p.dtype))
        for bname, b in model.named_buffers():
            if bname.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=gen, dtype=b.dtype))
    return model


class TracedWithReferences:
    """``name``'s tiny model (:func:`build`), its trace, and HF's greedy continuation of
    ``max_new`` tokens per prompt, computed once per prompt."""

    def __init__(self, max_new: int, name: str = "deepseek_v32"):
        import dcpgraph

        self.max_new = max_new
        self.model = build(name)
        self.program = dcpgraph.trace(self.model)
        self._refs: dict[tuple[int, ...], list[int]] = {}

    def ref(self, prompt) -> list[int]:
        from dcpgraph.testing.generation import hf_greedy

        key = tuple(prompt)
        if key not in self._refs:
            self._refs[key] = hf_greedy(self.model, prompt, self.max_new)
        return self._refs[key]
