"""Every TP-plan style against the unsharded model: greedy tokens equal HF ``generate`` (fp64).

Styles and where they are exercised:

* ``colwise`` / ``rowwise`` / ``embedding_rowwise`` (vocab parallel) / ``colwise_gather_output``
  (LM head): every GQA/MLA end-to-end test;
* ``packed_colwise`` + ``rowwise`` on grouped experts, ``moe_tp_experts``, ``grouped_gemm`` +
  ``ep_dispatch_experts``: tests/test_e2e_moe.py (Qwen3-MoE, DeepSeek-V3);
* here: GLM-4's own plan (``colwise_gather_output`` fused gate/up + ``rowwise_split_input``
  down), and Llama with plans overridden to ``colwise_rep`` + ``rowwise_rep``, MiniCPM-5-MoE's
  ``unit_colwise`` attention + ``unit_rowwise`` (2 KV heads: replicated at tp = 4),
  ``embedding_colwise``, and the replicated styles (``replicate``,
  ``sequence_parallel``, ``replicated_with_grad_allreduce``, ``local_params``) on norms;
* every style above and ``packed_rowwise`` (Aria's grouped experts) and ``all_reduce`` (a module
  style, on Qwen3-MoE's experts) at every valid (tp, dcp) in {1, 2, 4}²
  (:func:`test_every_style_matches_hf_at_every_valid_mesh`, slow);
* refused by name: ``moe_identity_expert``, unknown styles, plans leaving K/V unsharded (Phi-3's
  own ``colwise_gather_output`` qkv).
"""

from __future__ import annotations

import pytest
import torch

import dcpgraph
from dcpgraph.errors import UnsupportedModelError
from dcpgraph.passes.tp_styles import ALL_STYLES, PackedShardRule
from dcpgraph.testing.generation import drain, hf_greedy

transformers = pytest.importorskip("transformers")

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
              num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2,
              tie_word_embeddings=False, eos_token_id=2, pad_token_id=0)
PROMPT = [5, 9, 4, 77, 10, 11, 3]
NEW = 8


def _model(arch: str):
    config = transformers.AutoConfig.for_model(arch, **COMMON)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).to(torch.float64).eval()


def _tokens(program, tp, dcp=1, **kw):
    engine = dcpgraph.compile(program, tp=tp, dcp=dcp, block_size=4, **kw)
    engine.add_request(PROMPT, max_new_tokens=NEW)
    return drain(engine)[0], engine.program


def _plan(model, **overrides):
    program = dcpgraph.trace(model)
    plan = dict(program.facts.tp_plan)
    plan.update(overrides)
    return program, plan


LLAMA_VARIANTS = {
    "colwise_rep+rowwise_rep": {"model.layers.*.mlp.gate_proj": "colwise_rep",
                                "model.layers.*.mlp.up_proj": "colwise_rep",
                                "model.layers.*.mlp.down_proj": "rowwise_rep"},
    "embedding_colwise": {"model.embed_tokens": "embedding_colwise"},
    "unit_colwise+unit_rowwise": {"model.layers.*.self_attn.q_proj": "unit_colwise",
                                  "model.layers.*.self_attn.k_proj": "unit_colwise",
                                  "model.layers.*.self_attn.v_proj": "unit_colwise",
                                  "model.layers.*.self_attn.o_proj": "unit_rowwise"},
    "replicated styles": {"model.norm": "sequence_parallel", "model.layers.*.input_layernorm": "replicate",
                          "model.layers.*.post_attention_layernorm": "replicated_with_grad_allreduce",
                          "model.layers.*.self_attn": "local_params"},
}


@pytest.mark.parametrize("variant", sorted(LLAMA_VARIANTS))
@pytest.mark.parametrize(("tp", "dcp"), [(2, 1), (4, 2)])
def test_llama_with_overridden_styles_matches_hf(variant, tp, dcp):
    model = _model("llama")
    program, plan = _plan(model, **LLAMA_VARIANTS[variant])
    got, sharded = _tokens(program, tp, dcp, plan=plan)
    assert got == hf_greedy(model, PROMPT, NEW)
    if variant == "embedding_colwise":
        (spec,) = [s for s in sharded.inputs if s.target == "model.embed_tokens.weight"]
        assert spec.shard.dim == 1


def test_glm4_own_plan_split_input_matches_hf():
    model = _model("glm4")
    assert model.config.base_model_tp_plan["layers.*.mlp.down_proj"] == "rowwise_split_input"
    program = dcpgraph.trace(model)
    want = hf_greedy(model, PROMPT, NEW)
    for tp, dcp in ((2, 1), (4, 1), (4, 2)):
        got, sharded = _tokens(program, tp, dcp)
        assert got == want, (tp, dcp)
    rules = {s.target: s.shard.dim for s in sharded.inputs}
    assert rules["model.layers.0.mlp.gate_up_proj.weight"] == 0 and rules["model.layers.0.mlp.down_proj.weight"] == 1


def test_phi3_own_plan_leaving_kv_unsharded_is_refused_before_running():
    # dcpgraph's default plan splits the fused qkv by head; HF's own gathers it, which is refused.
    model = _model("phi3")
    program = dcpgraph.trace(model)
    hf_plan = {f"model.{k}": v for k, v in model.config.base_model_tp_plan.items()}
    with pytest.raises(UnsupportedModelError, match="K/V projection .*qkv_proj colwise_gather_output"):
        dcpgraph.compile(program, tp=2, plan=hf_plan)


def test_packed_shard_rule_keeps_gate_and_up_paired():
    full = torch.arange(8.0)[:, None].expand(8, 3)  # gate rows 0..3, up rows 4..7
    rule = PackedShardRule(0)
    assert rule.local(full, 1, 2)[:, 0].tolist() == [2, 3, 6, 7]
    assert rule.local_shape((8, 3), 2) == (4, 3)


@pytest.mark.parametrize(("style", "message"), [("moe_identity_expert", "identity experts"),
                                                ("frobnicate", "unknown; known styles")])
def test_refused_styles_are_named(style, message):
    model = _model("llama")
    program, plan = _plan(model, **{"model.layers.*.mlp.up_proj": style})
    with pytest.raises(UnsupportedModelError, match=f"{style}.*{message}"):
        _tokens(program, 2, plan=plan)
    assert "moe_identity_expert" in ALL_STYLES


# -- every implemented style, through a model, at every valid (tp, dcp) in {1, 2, 4}² ------------
# One KV head, so every mesh of {1, 2, 4}² with dcp <= tp is valid (DCP needs tp > KV heads).
# Styles not listed run in every case: colwise / rowwise (attention), embedding_rowwise (vocab
# parallel input embeddings) and colwise_gather_output (the LM head).
MOE = dict(num_experts=4, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
STYLE_CASES = {
    # case: (architecture, extra config, plan overrides, styles the resulting plan must contain)
    "colwise_rep+rowwise_rep": ("llama", {}, LLAMA_VARIANTS["colwise_rep+rowwise_rep"], {"colwise_rep", "rowwise_rep"}),
    "embedding_colwise": ("llama", {}, LLAMA_VARIANTS["embedding_colwise"], {"embedding_colwise"}),
    "replicated styles": ("llama", {}, LLAMA_VARIANTS["replicated styles"],
                          {"replicate", "sequence_parallel", "replicated_with_grad_allreduce", "local_params"}),
    "glm4 gather_output+split_input": ("glm4", {}, {}, {"colwise_gather_output", "rowwise_split_input"}),
    # Aria's experts store gate_up as [E, in, 2·out]: packed_rowwise splits its packed last dim.
    # transformers 5.24's own plan for Aria (5.25 dropped the expert entries from it, so it is given).
    "aria packed_rowwise experts": ("aria_text", MOE, {"model.layers.*.mlp.experts.gate_up_proj": "packed_rowwise",
                                                       "model.layers.*.mlp.experts.down_proj": "colwise",
                                                       "model.layers.*.mlp.experts": "moe_tp_experts"},
                                    {"packed_rowwise", "moe_tp_experts"}),
    "qwen3_moe experts all_reduce": ("qwen3_moe", MOE, {"model.layers.*.mlp.experts": "all_reduce"},
                                     {"packed_colwise", "all_reduce"}),
}
MESHES_1KV = [(1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (4, 4)]


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(STYLE_CASES))
def test_every_style_matches_hf_at_every_valid_mesh(case):
    arch, extra, overrides, styles = STYLE_CASES[case]
    config = transformers.AutoConfig.for_model(arch, **{**COMMON, "num_key_value_heads": 1, **extra})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.float64).eval()
    program, plan = _plan(model, **overrides)
    assert styles <= set(plan.values()), plan
    want = hf_greedy(model, PROMPT, NEW)
    from dcpgraph.mesh import Mesh

    facts = program.facts
    valid = []
    for tp, dcp in ((t, d) for t in (1, 2, 4) for d in (1, 2, 4)):
        try:
            Mesh(tp, dcp).validate(attention=facts.attention, num_q_heads=facts.num_q_heads,
                                   num_kv_heads=facts.num_kv_heads, block_size=4)
        except dcpgraph.errors.ConfigError:
            continue
        valid.append((tp, dcp))
    assert valid == MESHES_1KV
    for tp, dcp in valid:
        got, _ = _tokens(program, tp, dcp, plan=plan)
        assert got == want, (case, tp, dcp)
