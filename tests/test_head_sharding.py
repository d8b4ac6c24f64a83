"""Attention sharded by head whatever the model's own TP plan says: unplanned (GraniteMoE,
Hunyuan), gathered (OLMo-2's ``colwise_gather_output``), fused ``[q; k; v]`` (Phi-3), norms over
the whole projected width (OLMo-2's q/k norms, BitNet's ``attn_sub_norm``). Each model's greedy
tokens under emulated TP/DCP ranks are HF ``generate``'s on the same weights."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import dcpgraph  # noqa: E402
from dcpgraph.checkpoints.tensor_sources import read_local  # noqa: E402
from dcpgraph.frontends.hf import tp_plan  # noqa: E402
from dcpgraph.passes.tp_styles import QKVShardRule, plan_rule  # noqa: E402
from dcpgraph.testing.generation import drain, hf_greedy  # noqa: E402

VOCAB = 128
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.2,
              tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=None)
MODELS = {
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
    "bitnet": ("BitNetConfig", "BitNetForCausalLM", {}),
    "hunyuan_v1_dense": ("HunYuanDenseV1Config", "HunYuanDenseV1ForCausalLM", dict(head_dim=8)),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", {}),  # views with a hard-coded head count
}
PROMPT = (5, 9, 4, 77, 10, 11, 3, 40, 41)  # crosses two of the 4-token blocks
NEW_TOKENS = 8


def build(name: str) -> torch.nn.Module:
    import transformers

    config_cls, model_cls, extra = MODELS[name]
    config = getattr(transformers, config_cls)(**COMMON, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).to(torch.float64).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.normal_(1.0, 0.3)  # a norm weight of ones would hide a mis-sharded one
            elif pname.endswith("bias"):
                p.normal_(0.0, 0.3)
    return model


def greedy(model, tp: int, dcp: int) -> list[int]:
    engine = dcpgraph.compile(model, tp=tp, dcp=dcp, block_size=4, max_num_batched_tokens=8)
    engine.add_request(list(PROMPT), max_new_tokens=NEW_TOKENS)
    return drain(engine)[0]


def test_plans_replace_gathered_and_unplanned_attention_by_head_sharded_entries():
    olmo2 = tp_plan(build("olmo2"))
    assert plan_rule(olmo2, "model.layers.0.self_attn.k_proj") == "colwise"  # HF: colwise_gather_output
    assert plan_rule(olmo2, "model.layers.1.self_attn.o_proj") == "rowwise"  # HF: rowwise_split_input
    assert plan_rule(olmo2, "model.layers.0.self_attn.q_norm") == "norm_colwise"
    assert plan_rule(olmo2, "model.layers.0.mlp.gate_proj") == "colwise"  # the rest of HF's plan stays
    phi3 = tp_plan(build("phi3"))
    assert plan_rule(phi3, "model.layers.0.self_attn.qkv_proj") == "qkv_colwise"
    hunyuan = tp_plan(build("hunyuan_v1_dense"))  # HF plans only the embedding
    assert plan_rule(hunyuan, "model.layers.0.self_attn.v_proj") == "colwise"
    assert plan_rule(hunyuan, "model.layers.0.self_attn.query_layernorm") is None  # per head: replicated


def test_a_module_with_unknown_parameters_keeps_the_models_plan():
    model = build("hunyuan_v1_dense")
    for layer in model.model.layers:
        layer.self_attn.register_parameter("scale", torch.nn.Parameter(torch.ones(3, dtype=torch.float64)))
    plan = tp_plan(model)
    assert plan_rule(plan, "model.layers.0.self_attn.k_proj") is None


def test_qkv_rule_keeps_each_ranks_heads_of_q_k_and_v():
    q_rows, kv_rows = 8 * 4, 2 * 4  # 8 query heads, 2 KV heads, head_dim 4
    full = torch.arange(q_rows + 2 * kv_rows, dtype=torch.float64).unsqueeze(1).expand(-1, 3)
    rule = QKVShardRule(0, q_rows=q_rows, kv_rows=kv_rows, kv_heads=2)
    locals_ = [rule.local(full, r, 4) for r in range(4)]
    assert [t[:, 0].tolist() for t in locals_][1] == [*range(8, 16), *range(32, 36), *range(40, 44)]
    assert locals_[3][8:, 0].tolist() == [*range(36, 40), *range(44, 48)]  # KV head 1, replicated on ranks 2, 3
    assert all(tuple(t.shape) == rule.local_shape(tuple(full.shape), 4) for t in locals_)

    class Source:
        shape = tuple(full.shape)

        def read(self, dim, start=None, stop=None):
            return full if dim is None else full.narrow(dim, start, stop - start)

    assert all(torch.equal(read_local(Source(), rule, r, 4), locals_[r]) for r in range(4))
    with pytest.raises(ValueError, match="cannot split"):
        QKVShardRule(0, q_rows=12, kv_rows=8, kv_heads=2).local(torch.zeros(28, 2), 0, 8)


@pytest.mark.parametrize("name, tp, dcp", [("olmo2", 4, 2), ("phi3", 4, 2)])
def test_greedy_tokens_match_hf(name, tp, dcp):
    model = build(name)
    want = hf_greedy(model, PROMPT, NEW_TOKENS)
    assert len(set(want)) > 2, want  # not a degenerate reference
    assert greedy(model, tp, dcp) == want


@pytest.mark.slow  # ~3 min on 2 loaded cores: every model on every mesh
@pytest.mark.parametrize("name", sorted(MODELS))
def test_greedy_tokens_match_hf_on_every_mesh(name):
    model = build(name)
    want = hf_greedy(model, PROMPT, NEW_TOKENS)
    for tp, dcp in ((1, 1), (2, 1), (4, 1), (4, 2)):
        assert greedy(model, tp, dcp) == want, (tp, dcp)
