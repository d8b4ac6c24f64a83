"""Tiny seeded hybrid models for the recurrent-layer tests (``test_frontend_recurrent``,
``test_recurrent_program``, ``test_e2e_hybrid``, and the Mamba-2 ones: ``test_frontend_mamba2``,
``test_mamba2_layer``, ``test_e2e_mamba2``, and ``test_lightning_mesh``, ``test_olmo_hybrid_mesh``;
the Kimi delta attention ones: ``test_kimi_delta_layer``, ``test_kda_mesh``; and the acceptance
matrix, ``test_hybrid_acceptance``), with transformers' default implementations (weights
initialised at 0.2, not 0.02, so greedy tokens vary).

``qwen3_next``: 4 layers, 3 gated-delta-net layers (2 key heads, 4 value heads, head dims 8, conv
kernel 4) and one gated attention layer, dense MLPs (``mlp_only_layers``). ``lfm2``: short
convolution (cache 3), full attention, short convolution. fp32, weights N(0, 0.2), no EOS (so a
greedy run always emits every token asked)."""

from __future__ import annotations

import torch
import transformers

VOCAB = 67
"""Not divisible by tp = 2 or 4, as many real checkpoints' vocabularies are not: the embedding and
the LM head are split with a ragged last shard at every mesh these models run."""


def qwen3_next(kv_heads: int = 2, key_heads: int = 2) -> torch.nn.Module:
    config = transformers.Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=kv_heads, head_dim=8, linear_num_key_heads=key_heads, linear_num_value_heads=2 * key_heads,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4, mlp_only_layers=[0, 1, 2, 3],
        initializer_range=0.2, eos_token_id=None)
    torch.manual_seed(0)
    return transformers.Qwen3NextForCausalLM(config).eval()


def lfm2(kv_heads: int = 2) -> torch.nn.Module:
    config = transformers.Lfm2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=kv_heads, conv_L_cache=3, layer_types=["conv", "full_attention", "conv"],
        initializer_range=0.2, eos_token_id=None)
    torch.manual_seed(0)
    return transformers.Lfm2ForCausalLM(config).eval()


def qwen3_5(kv_heads: int = 1, key_heads: int = 4) -> torch.nn.Module:
    """qwen3_5_text: the split projection layout (``in_proj_qkv``, ``in_proj_z/b/a``); 3 gated delta
    net layers and one gated attention layer, as :func:`qwen3_next`'s dims."""
    config = transformers.Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=kv_heads, head_dim=8, linear_num_key_heads=key_heads, linear_num_value_heads=2 * key_heads,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"], initializer_range=0.2, eos_token_id=None)
    torch.manual_seed(0)
    return transformers.Qwen3_5ForCausalLM(config).eval()


def olmo_hybrid(kv_heads: int = 1, key_heads: int = 4) -> torch.nn.Module:
    """olmo_hybrid: the separate-projection layout (``q/k/v/g/b/a_proj``, ``o_norm``, ``o_proj``,
    ``β`` doubled by transformers' default ``linear_allow_neg_eigval``); 3 gated delta net layers
    and one attention layer, as :func:`qwen3_next`'s dims."""
    config = transformers.OlmoHybridConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=kv_heads, linear_num_key_heads=key_heads, linear_num_value_heads=2 * key_heads,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"], initializer_range=0.2, eos_token_id=None,
        pad_token_id=0)
    torch.manual_seed(0)
    return transformers.OlmoHybridForCausalLM(config).eval()


MODELS = {"qwen3_next": qwen3_next, "lfm2": lfm2}
MESH_MODELS = {"qwen3_next": lambda: qwen3_next(kv_heads=1, key_heads=4), "lfm2": lambda: lfm2(kv_heads=1),
               "qwen3_5": qwen3_5, "olmo_hybrid": olmo_hybrid}
"""The same architectures with one KV head (so DCP has KV replication to remove up to dcp = tp)
and, for the gated delta nets (qwen3_next, qwen3_5_text), 4 key heads / 8 value heads (so tp=4 splits the gated delta nets)."""


# Mamba-2 hybrids: 8 heads of 8 channels (I = 64 = 2·hidden), 2 groups of B/C with state 8, conv
# kernel 4, HF's scan chunk 4 (so the reference itself runs several chunks).
_MAMBA2 = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
               initializer_range=0.2, eos_token_id=None, pad_token_id=0)


def bamba(kv_heads: int = 2, groups: int = 2) -> torch.nn.Module:
    """Mamba-2, attention, Mamba-2 (``attn_layer_indices=[1]``)."""
    config = transformers.BambaConfig(
        **{**_MAMBA2, "num_key_value_heads": kv_heads}, num_hidden_layers=3, attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=groups,
        mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=4)
    torch.manual_seed(0)
    return transformers.BambaForCausalLM(config).eval()


def nemotron_h(kv_heads: int = 2, groups: int = 2) -> torch.nn.Module:
    """``hybrid_override_pattern`` ``M*-E``: Mamba-2, attention, MLP, MoE."""
    config = transformers.NemotronHConfig(
        **{**_MAMBA2, "num_key_value_heads": kv_heads}, hybrid_override_pattern="M*-E", head_dim=8, mamba_num_heads=8, mamba_head_dim=8, n_groups=groups,
        ssm_state_size=8, conv_kernel=4, chunk_size=4, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, moe_shared_expert_intermediate_size=16, n_group=1, topk_group=1)
    torch.manual_seed(0)
    return transformers.NemotronHForCausalLM(config).eval()


def granitemoehybrid(kv_heads: int = 2, groups: int = 2) -> torch.nn.Module:
    """Mamba-2, attention, Mamba-2 with 4 experts (top 2)."""
    config = transformers.GraniteMoeHybridConfig(
        **{**_MAMBA2, "num_key_value_heads": kv_heads}, num_hidden_layers=3, layer_types=["mamba", "attention", "mamba"], mamba_n_heads=8, mamba_d_head=8,
        mamba_n_groups=groups, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=4, num_local_experts=4,
        num_experts_per_tok=2)
    torch.manual_seed(0)
    return transformers.GraniteMoeHybridForCausalLM(config).eval()


def falcon_h1(kv_heads: int = 2, groups: int = 2, ssm_multipliers: list[float] | None = None) -> torch.nn.Module:
    """Two layers of attention beside Mamba-2 (µP multipliers as transformers defaults them, or the
    ``[z, x, B, C, dt]`` ``ssm_multipliers`` given)."""
    config = transformers.FalconH1Config(
        **{**_MAMBA2, "num_key_value_heads": kv_heads}, num_hidden_layers=2, head_dim=8, mamba_d_ssm=64, mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=groups,
        mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=4, ssm_multipliers=ssm_multipliers)
    torch.manual_seed(0)
    return transformers.FalconH1ForCausalLM(config).eval()


MAMBA2_MODELS = {"bamba": bamba, "nemotron_h": nemotron_h, "granitemoehybrid": granitemoehybrid,
                 "falcon_h1": falcon_h1}
MAMBA2_MESH_MODELS = {name: (lambda build=build: build(kv_heads=1, groups=4)) for name, build in MAMBA2_MODELS.items()}
"""The Mamba-2 hybrids with one KV head (DCP has KV replication to remove up to dcp = tp) and 4
groups of B/C (so tp = 2 and tp = 4 both split the mixers by whole groups)."""


def minimax(kv_heads: int = 1, heads: int = 4, block_size: int = 4) -> torch.nn.Module:
    """Lightning attention, full attention, lightning attention, full attention (HF's default
    pattern shifted to start linear: ``layer_types``), 4 heads of 8 in both kinds, a sparse MoE of 4
    experts (top 2), HF's prefill block of ``block_size`` (so a prompt spans several blocks) and
    residual factors other than 1 (``*_alpha_factor``/``*_beta_factor``), so all are exercised."""
    config = transformers.MiniMaxConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=4, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
        layer_types=["linear_attention", "full_attention"] * 2, block_size=block_size,
        linear_attn_alpha_factor=0.9, linear_attn_beta_factor=1.1, full_attn_alpha_factor=1.2,
        full_attn_beta_factor=0.8, mlp_alpha_factor=0.7, mlp_beta_factor=1.3,
        initializer_range=0.2, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    return transformers.MiniMaxForCausalLM(config).eval()


LIGHTNING_MESH_MODELS = {"minimax": minimax}
"""MiniMax with one KV head (DCP has KV replication to remove up to dcp = tp) and 4 lightning heads
(so tp = 2 and tp = 4 both split the lightning layers by heads)."""
# -- speculative decoding ------------------------------------------------------------------------
SPEC_MODELS = {"qwen3_next": MESH_MODELS["qwen3_next"], "lfm2": MESH_MODELS["lfm2"],
               "bamba": MAMBA2_MESH_MODELS["bamba"]}
"""One hybrid per recurrent kind (gated delta net, short convolution, Mamba-2), each valid at tp2·dcp2."""

SPEC_PROMPTS = [[3, 4, 3, 4, 3, 4, 3], [1, 2, 3, 1, 2, 3, 1, 2], [5, 6, 7, 5, 6, 7, 5, 6, 7],
                [3, 4, 3, 4, 3, 4, 3, 41, 37, 46, 35, 3, 4, 3, 4, 3]]
SPEC_NEW_TOKENS = 16
"""Repetitive prompts: prompt lookup drafts from them, and on these seeded models some of those
drafts are accepted and most are rejected (each model accepts at least one: qwen3_next on the first
prompt, lfm2 on the third, bamba on the last: the first prompt, bamba's first four greedy tokens
after it, and the first prompt again; 16 tokens, so a request fits the gloo test's 32-token cache)."""


def ngram(k: int = 3) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1}


def llama_draft() -> torch.nn.Module:
    """A one-layer Llama over the hybrids' vocabulary: a draft model without recurrent layers."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=1, head_dim=8, initializer_range=0.2, eos_token_id=None)
    torch.manual_seed(1)
    return transformers.LlamaForCausalLM(config).eval()


# Kimi delta attention (KDA) hybrids: KDA, KDA, MLA attention, KDA; KDA heads of 8 channels
# (q, k and v alike), conv kernel 4; MLA with latent rank 16, nope/rope/v dims 8, 4 heads (one
# latent KV head after absorption, so DCP up to tp); layer 0 a dense MLP, the others MoE with 4
# experts (top 2) and a shared expert, with transformers' default experts implementation.
_KDA = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
            v_head_dim=8, q_lora_rank=None,
            layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
            num_experts=4, num_experts_per_token=2, num_shared_experts=1, num_expert_group=1, topk_group=1,
            initializer_range=0.2, eos_token_id=None, pad_token_id=0, bos_token_id=1)


def kimi_linear(kda_heads: int = 4) -> torch.nn.Module:
    """kimi_linear: low-rank forget and output gates, MLA without rotary."""
    config = transformers.KimiLinearConfig(**_KDA, linear_num_heads=kda_heads, linear_head_dim=8,
                                           linear_conv_kernel_dim=4)
    torch.manual_seed(0)
    return transformers.KimiLinearForCausalLM(config).eval()


def bailing_hybrid(kda_safe_gate: bool = True) -> torch.nn.Module:
    """bailing_hybrid: full-rank gates, the bounded ("safe") forget gate by default, MLA with
    interleaved rotary and a per-head sigmoid output gate. Its KDA heads are its attention heads."""
    config = transformers.BailingHybridConfig(**_KDA, head_dim=8, short_conv_kernel_size=4, first_k_dense_replace=1,
                                              kda_safe_gate=kda_safe_gate)
    torch.manual_seed(0)
    return transformers.BailingHybridForCausalLM(config).eval()


KDA_MESH_MODELS = {"kimi_linear": kimi_linear, "bailing_hybrid": bailing_hybrid}


# -- one run through prefill chunks and a preemption --------------------------------------------
PROMPTS = [[5, 9, 3, 17, 22, 40, 8, 1, 33, 12, 60], [7, 7, 30, 2, 19, 44], [1, 2, 3]]
NEW_TOKENS = 6


def run_through_preemption(model: torch.nn.Module, program):
    """Compile ``program`` with 8-token prefill chunks and 7 blocks of 4 (too few for all three
    :data:`PROMPTS`), run them greedily, and check the tokens equal HF ``generate``'s, at least one
    preemption happened and every state slot came back; the engine, for further checks."""
    import dcpgraph
    from dcpgraph.testing.generation import drain, hf_greedy

    want = [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]
    engine = dcpgraph.compile(program, block_size=4, max_num_batched_tokens=8, num_blocks=7)
    for prompt in PROMPTS:
        engine.add_request(prompt, max_new_tokens=NEW_TOKENS)
    got = drain(engine)
    assert [got[i] for i in range(len(PROMPTS))] == want
    assert engine.scheduler.stats["preemptions"] >= 1  # 7 blocks of 4 cannot hold all three
    assert sorted(engine.scheduler.state_slots.free) == list(range(engine.program.lowering.state_slots))
    return engine


def drive_on_gloo(rank: int, world: int, family: str, name: str, speculative_config: dict | None = None) -> dict:
    """One rank of a real gloo world at tp=``world``·dcp=2 running the hybrid ``name`` of
    ``family`` (:data:`MESH_MODELS`, :data:`MAMBA2_MESH_MODELS`, :data:`LIGHTNING_MESH_MODELS` or
    :data:`KDA_MESH_MODELS`), as ``LLM``/``serve`` run it:
    rank 0 drives (schedules, ships each step with its state slots) and returns the greedy tokens
    of :data:`PROMPTS` through prefill chunks and a preemption, its executor, preemptions and
    memory and speculative reports (with ``speculative_config``: of :data:`SPEC_PROMPTS` too,
    ``spec_tokens``); every rank returns its state pools' shapes."""
    from dcpgraph.api import compile_programs, engine_for
    from dcpgraph.runtime.step_broadcast import ControlGroup, driver_executors, follow

    control = ControlGroup()
    compiled = compile_programs(globals()[family][name](), tp=world, dcp=2, block_size=4, num_blocks=4,
                                max_num_batched_tokens=8, max_num_seqs=4, executor="distributed",
                                speculative_config=speculative_config)
    pools = {p.name: p.shape for p in compiled.program.recurrent_states}
    if rank != 0:
        follow(control, {"target": (compiled.program, compiled.graphs)})
        return {"pools": pools}
    engine = engine_for(compiled, driver_executors(control, {"target": compiled.program}))
    tokens = engine.generate([list(p) for p in PROMPTS], NEW_TOKENS)
    result = {"tokens": tokens, "pools": pools, "executor": engine.report()["executor"],
              "preemptions": engine.scheduler.stats["preemptions"], "memory": engine.memory_report()}
    if speculative_config is not None:
        result["spec_tokens"] = engine.generate([list(p) for p in SPEC_PROMPTS], SPEC_NEW_TOKENS)
        result["speculative"] = engine.speculative_report()
    control.broadcast(("stop",))
    return result


# -- the acceptance matrix (tests/test_hybrid_acceptance.py) ---------------------------------------
ACCEPTANCE_MODELS = {
    "qwen3_5_text": MESH_MODELS["qwen3_5"], "qwen3_next": MESH_MODELS["qwen3_next"],
    "kimi_linear": KDA_MESH_MODELS["kimi_linear"], "nemotron_h": MAMBA2_MESH_MODELS["nemotron_h"],
    "granitemoehybrid": MAMBA2_MESH_MODELS["granitemoehybrid"], "falcon_h1": MAMBA2_MESH_MODELS["falcon_h1"],
    "minimax": LIGHTNING_MESH_MODELS["minimax"], "lfm2": MESH_MODELS["lfm2"], "bamba": MAMBA2_MESH_MODELS["bamba"],
}
"""The eight hybrids the acceptance names (and bamba, the fourth Mamba-2 family), each in its mesh
variant: one KV head (or MLA's one latent head), recurrent heads/channels/groups that tp = 2 and
tp = 4 divide, so every mesh among tp2·dcp2, tp4·dcp2 and tp4·dcp4 is valid and splits the state."""


GLOO_PREFIX_PROMPT = [*PROMPTS[0], 3, 4, 5]
"""The first of :data:`PROMPTS` and three more tokens: at tp2·dcp2 (virtual blocks of 8) it hits that
prompt's first block, whose state the first prefill chunk left."""


def drive_models_on_gloo(rank: int, world: int, names: list[str]) -> dict:
    """One rank of a real gloo world at tp=``world``·dcp=2 that serves each of ``names``
    (:data:`ACCEPTANCE_MODELS`) in turn, as :func:`drive_on_gloo` serves one, with prefix caching:
    per model, rank 0 drives :data:`PROMPTS` through prefill chunks and a preemption, then
    :data:`GLOO_PREFIX_PROMPT` (a hit on the first prompt's block and its kept state), and returns
    the greedy tokens, its executor, preemptions, memory report and state prefix-cache counters;
    every rank returns its state pools' shapes. One world for all of them, so the process start is
    paid once."""
    from dcpgraph.api import compile_programs, engine_for
    from dcpgraph.runtime.step_broadcast import ControlGroup, driver_executors, follow

    control = ControlGroup()
    results = {}
    for name in names:
        compiled = compile_programs(ACCEPTANCE_MODELS[name](), tp=world, dcp=2, block_size=4, num_blocks=4,
                                    max_num_batched_tokens=8, max_num_seqs=4, executor="distributed",
                                    enable_prefix_caching=True)
        pools = {p.name: p.shape for p in compiled.program.recurrent_states}
        if rank != 0:
            follow(control, {"target": (compiled.program, compiled.graphs)})
            results[name] = {"pools": pools}
            continue
        engine = engine_for(compiled, driver_executors(control, {"target": compiled.program}))
        tokens = engine.generate([list(p) for p in PROMPTS], NEW_TOKENS)
        results[name] = {"tokens": tokens, "pools": pools, "executor": engine.report()["executor"],
                         "preemptions": engine.scheduler.stats["preemptions"], "memory": engine.memory_report(),
                         "prefix_tokens": engine.generate([GLOO_PREFIX_PROMPT], NEW_TOKENS)[0],
                         "state_prefix": dict(engine.scheduler.state_prefix.stats)}
        control.broadcast(("stop",))
    return results
