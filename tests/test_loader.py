"""Shard-by-shard checkpoint loading (:mod:`dcpgraph.checkpoints.loader`).

References: ``ShardRule.local`` / ``PackedShardRule.local`` on eagerly built full tensors for the
slice readers; HF ``generate`` (fp64, ``from_pretrained``) for the tokens of engines whose every
rank read only its own slices (emulated executor: ``local_state(r)`` per rank, each a separate
read); the LLM's worker processes at tp=2/dcp=2 are covered in ``test_llm.py``.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

import dcpgraph
from dcpgraph import LLM, ConfigError
from dcpgraph.checkpoints.loader import check_checkpoint, load_program
from dcpgraph.checkpoints.model_dir import load_model
from dcpgraph.checkpoints.tensor_sources import (
    AbsorbedMLA,
    Concatenated,
    InMemory,
    SafetensorsFiles,
    Stacked,
    Stored,
    read_local,
)
from dcpgraph.passes.absorb_mla import absorbed
from dcpgraph.passes.tp_styles import PackedShardRule
from dcpgraph.program import ShardRule
from dcpgraph.testing.checkpoints import quantize_checkpoint_fp8, save_tiny_checkpoint
from dcpgraph.testing.generation import hf_greedy

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
NEW_TOKENS = 8


# -- slice readers against ShardRule.local on full tensors ---------------------------------------
RULES = [ShardRule(None), ShardRule(0), ShardRule(1), ShardRule(-1), ShardRule(-2), ShardRule(0, parts=2),
         PackedShardRule(1), PackedShardRule(-2), PackedShardRule(0)]


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_read_local_equals_shard_rule_local_for_every_source(tp):
    gen = torch.Generator().manual_seed(tp)
    parts = [[torch.randn(8, 16, generator=gen) for _ in range(2)] for _ in range(4)]
    experts = Stacked(tuple(Concatenated((InMemory(g, "g"), InMemory(u, "u")), 0) for g, u in parts))
    full_experts = torch.stack([torch.cat([g, u], 0) for g, u in parts])
    up = torch.randn(4 * (3 + 5), 8, generator=gen)  # 4 heads, nope 3, v 5, rank 8
    cases = [(experts, full_experts), (InMemory(up, "up"), up)]
    cases += [(AbsorbedMLA(InMemory(up, "up"), op, 3, 5, 8), absorbed(up, op, 3, 5, 8))
              for op in ("mla_absorbed_uk", "mla_absorbed_uv_t")]
    checked = 0
    for source, full in cases:
        assert source.shape == tuple(full.shape)
        for rule in RULES:
            dim = None if rule.dim is None else rule.dim % full.dim()
            packed = getattr(rule, "packed", 1)
            if dim is not None and full.shape[dim] % (tp * packed):
                continue
            if isinstance(source, AbsorbedMLA) and dim not in (None, 0):
                continue  # absorbed weights are split by heads only; other dims read whole, then narrow
            for rank in range(tp):
                assert torch.equal(read_local(source, rule, rank, tp), rule.local(full, rank, tp)), (rule, rank)
                checked += 1
    assert checked > 20


def test_sharded_files_read_slices_across_index_shards(tmp_path):
    path = save_tiny_checkpoint(tmp_path / "sharded", "qwen3", max_shard_size="40KB")
    index = json.load(open(os.path.join(path, "model.safetensors.index.json")))
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1
    stored = SafetensorsFiles(path, tuple(files))
    everything = {}
    for name in files:
        everything.update(load_file(os.path.join(path, name)))
    assert stored.names() == sorted(everything)
    for name, full in everything.items():
        source = Stored(stored, name)
        assert torch.equal(source.read(None), full)
        if full.dim() == 2:
            assert torch.equal(read_local(source, ShardRule(1), 1, 2), ShardRule(1).local(full, 1, 2))


# -- engines on sharded loading equal HF generate ------------------------------------------------
@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("loader")
    return {
        "qwen3": save_tiny_checkpoint(root / "qwen3", "qwen3", dtype=torch.float64),
        "llama-sharded": save_tiny_checkpoint(root / "llama", "llama", dtype=torch.float64, max_shard_size="40KB"),
        "deepseek_v2": save_tiny_checkpoint(root / "dsv2", "deepseek_v2", dtype=torch.float64),
        "deepseek_v3-sharded": save_tiny_checkpoint(root / "dsv3", "deepseek_v3", dtype=torch.float64,
                                                    max_shard_size="40KB"),
        # Gemma's embedding module keeps a non-persistent ``embed_scale`` (√hidden) beside its
        # weight: computed from the config at load time, the weight never allocated for it.
        **{name: _save_sliding(root / name, name) for name in ("gemma2", "gemma3_text", "gpt_oss")},
        # transformers writes Mixtral's legacy names (block_sparse_moe, experts.{e}.w1/w2/w3)
        "mixtral": _save_hf(root / "mixtral", "MixtralConfig", num_local_experts=4, num_experts_per_tok=2),
    }


def _save_hf(path, config_name: str, **overrides) -> str:
    import transformers as tf

    config = getattr(tf, config_name)(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=1, head_dim=8, max_position_embeddings=128, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False, **overrides)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config).double().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, 0.2)
    model.save_pretrained(path)
    return str(path)


def _save_sliding(path, name: str) -> str:
    from sliding_models import build

    build(name).save_pretrained(path)
    return str(path)


def _hf_tokens(path: str) -> list[int]:
    model = load_model(path, "float64")
    return hf_greedy(model, PROMPT, NEW_TOKENS)


@pytest.mark.parametrize("name,tp,dcp,options", [
    ("qwen3", 1, 1, {}),
    ("qwen3", 2, 2, {}),
    ("llama-sharded", 2, 2, {}),
    ("deepseek_v2", 1, 1, {}),
    ("deepseek_v2", 2, 2, {}),
    ("deepseek_v3-sharded", 2, 2, {}),
    ("deepseek_v3-sharded", 2, 1, {"enable_expert_parallel": True}),
    ("gemma2", 1, 1, {}),
    ("gemma3_text", 2, 2, {}),
    ("gemma3_text", 1, 1, {"hybrid_kv_cache": True}),
    # GPT-OSS's config plans only its embedding: attention is sharded by head (and its sinks with
    # them) by dcpgraph's default, experts replicated or, with expert parallelism, partitioned.
    ("gpt_oss", 2, 2, {}),
    ("gpt_oss", 2, 2, {"enable_expert_parallel": True}),
    ("mixtral", 2, 2, {}),
    ("mixtral", 2, 1, {"enable_expert_parallel": True}),
])
def test_sharded_loading_generates_hf_tokens(checkpoints, name, tp, dcp, options):
    path = checkpoints[name]
    program = load_program(path, "float64")
    assert all(t.device.type == "meta" for t in program.state.values()
               if t.dim() > 1), "weights must not be materialised before a rank reads its slices"
    engine = dcpgraph.compile(program, tp=tp, dcp=dcp, block_size=4, executor="emulated", **options)
    assert engine.generate([PROMPT], NEW_TOKENS)[0] == _hf_tokens(path)


def _num_hidden_layers(path: str) -> int:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)["num_hidden_layers"]


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    """A DeepSeek-V3 tiny checkpoint in fp8 (16 x 16 tiles, partial ones at 24- and 40-wide
    edges) and, beside it, the same model with those weights dequantized by hand, tile by tile."""
    root = tmp_path_factory.mktemp("fp8")
    quantized_dir = save_tiny_checkpoint(root / "fp8", "deepseek_v3", dtype=torch.float64, mtp_weights=True)
    names = quantize_checkpoint_fp8(quantized_dir, (16, 16))
    reference_dir = save_tiny_checkpoint(root / "dequantized", "deepseek_v3", dtype=torch.float64, mtp_weights=True)
    stored = load_file(os.path.join(quantized_dir, "model.safetensors"))
    plain = load_file(os.path.join(reference_dir, "model.safetensors"))
    for name in names:
        q, scale = stored[name].to(torch.float32), stored[name + "_scale_inv"]
        w = torch.empty_like(q)
        for i in range(scale.shape[0]):
            for j in range(scale.shape[1]):
                w[i * 16:(i + 1) * 16, j * 16:(j + 1) * 16] = q[i * 16:(i + 1) * 16, j * 16:(j + 1) * 16] * scale[i, j]
        plain[name] = w.to(torch.float64)
    mtp = f"model.layers.{_num_hidden_layers(quantized_dir)}."
    save_file({n: t for n, t in plain.items() if not n.startswith(mtp)},  # HF's model has no MTP layer
              os.path.join(reference_dir, "model.safetensors"), metadata={"format": "pt"})
    return quantized_dir, reference_dir, names, plain


@pytest.mark.parametrize("tp,dcp,options", [(1, 1, {}), (2, 2, {}), (2, 1, {"enable_expert_parallel": True})])
def test_an_fp8_block_quantized_checkpoint_runs_its_dequantized_weights(fp8_checkpoint, tp, dcp, options):
    quantized_dir, reference_dir, names, _ = fp8_checkpoint
    assert any(".experts." in n for n in names) and any("kv_a_proj_with_mqa" in n for n in names)
    program = load_program(quantized_dir, "float64")
    engine = dcpgraph.compile(program, tp=tp, dcp=dcp, block_size=4, executor="emulated", **options)
    assert engine.generate([PROMPT], NEW_TOKENS)[0] == _hf_tokens(reference_dir)


def test_fp8_slices_read_only_their_tiles_and_equal_the_whole(fp8_checkpoint):
    from dcpgraph.checkpoints.loader import open_checkpoint

    quantized_dir, _, _, want = fp8_checkpoint
    sources = open_checkpoint(quantized_dir, "float64")[1]
    for name in ("model.layers.0.self_attn.kv_a_proj_with_mqa.weight", "model.layers.1.self_attn.o_proj.weight"):
        source, full = sources[name], want[name]
        assert torch.equal(source.read(None).double(), full)
        for dim in (0, 1):  # slices starting inside a tile and ending inside another
            n = full.shape[dim]
            for start, stop in ((0, n // 2), (n // 2, n), (5, n - 3)):
                assert torch.equal(source.read(dim, start, stop).double(), full.narrow(dim, start, stop - start))


def test_fp8_mtp_layer_weights_are_dequantized_too(fp8_checkpoint):
    from dcpgraph.speculative.mtp_module import _checkpoint_module

    quantized_dir, _, names, want = fp8_checkpoint
    _, _, sources = _checkpoint_module(quantized_dir, torch.float64, 0, "mla", "meta")
    layer = f"model.layers.{_num_hidden_layers(quantized_dir)}."
    checked = [n for n in names if n.startswith(layer) and n in sources]
    assert checked, "the MTP layer has quantized weights"
    for name in checked:
        assert torch.equal(sources[name].read(None).double(), want[name]), name


def test_other_quantizations_are_refused_by_name(tmp_path):
    path = save_tiny_checkpoint(tmp_path / "awq", "qwen3")
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ConfigError, match=r"quant_method: 'awq'.* is not supported; dcpgraph reads unquantized"):
        check_checkpoint(path, "float32")


def test_checkpoint_names_follow_transformers_conversion_mapping(checkpoints):
    from dcpgraph.checkpoints.names import CheckpointNames
    from dcpgraph.checkpoints.tensor_sources import SafetensorsFiles

    files = SafetensorsFiles(checkpoints["mixtral"], ("model.safetensors",))
    names = CheckpointNames.for_model_type("mixtral")
    gate = names.source("model.layers.1.mlp.gate.weight", (4, 64), files)
    assert gate.describe() == "model.layers.1.block_sparse_moe.gate.weight"
    gate_up = names.source("model.layers.1.mlp.experts.gate_up_proj", (4, 192, 64), files)
    assert [[q.name for q in e.parts] for e in gate_up.parts] == [
        [f"model.layers.1.block_sparse_moe.experts.{e}.{w}.weight" for w in ("w1", "w3")] for e in range(4)]
    full = load_file(os.path.join(checkpoints["mixtral"], "model.safetensors"))
    want = torch.stack([torch.cat([full[f"model.layers.1.block_sparse_moe.experts.{e}.{w}.weight"]
                                   for w in ("w1", "w3")]) for e in range(4)])
    assert torch.equal(gate_up.read(None), want)
    assert names.source("model.layers.1.mlp.experts.gate_up_proj", (5, 192, 64), files) is None  # a 5th expert
    default = CheckpointNames.for_model_type(None)  # no mapping: the per-expert names most checkpoints use
    assert [m.target for m in default.merges] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def test_unplanned_attention_is_sharded_by_head_only_where_the_config_is_silent(checkpoints):
    from dcpgraph.frontends.hf import tp_plan

    plans = {name: tp_plan(load_model(checkpoints[name], "float64")) for name in ("gpt_oss", "qwen3", "deepseek_v2")}
    attention = {k: v for k, v in plans["gpt_oss"].items() if ".self_attn." in k}
    assert attention == {"model.layers.*.self_attn.q_proj": "colwise", "model.layers.*.self_attn.k_proj": "colwise",
                         "model.layers.*.self_attn.v_proj": "colwise", "model.layers.*.self_attn.o_proj": "rowwise",
                         "model.layers.*.self_attn.sinks": "colwise"}
    import transformers as tf

    for name in ("qwen3", "deepseek_v2"):  # the config's own attention plan, untouched
        config = tf.AutoConfig.from_pretrained(checkpoints[name])
        own = {f"model.{k}": v for k, v in config.base_model_tp_plan.items() if ".self_attn." in k}
        assert {k: v for k, v in plans[name].items() if ".self_attn." in k} == own


@pytest.mark.parametrize("name", ["qwen3", "deepseek_v3-sharded"])
def test_each_rank_reads_exactly_its_shard_of_the_full_state(checkpoints, name):
    """Rank r's tensors at tp=2 equal ``ShardRule.local`` of the tensors a tp=1 load reads whole
    (fused experts and absorbed MLA weights included), and each rank holds about half."""
    from dcpgraph.mesh import Mesh
    from dcpgraph.passes.pipeline import compile_program
    from dcpgraph.program import STATE_KINDS

    program = load_program(checkpoints[name], "float64")
    full = compile_program(program, Mesh(1, 1), block_size=4)
    half = compile_program(program, Mesh(2, 1), block_size=4)
    whole = {s.target: t for s, t in zip([s for s in full.inputs if s.kind in STATE_KINDS], full.local_state(0))}
    specs = [s for s in half.inputs if s.kind in STATE_KINDS]
    assert any(s.shard.dim is not None for s in specs)
    for rank in range(2):
        local = half.local_state(rank)
        for spec, tensor in zip(specs, local):
            assert torch.equal(tensor, spec.shard.local(whole[spec.target], rank, 2)), (spec.target, rank)
        held = sum(t.numel() for t in local)
        assert held < 0.6 * sum(t.numel() for t in whole.values())


def test_dtype_comes_from_the_config_unless_overridden(tmp_path):
    path = save_tiny_checkpoint(tmp_path / "bf16", "llama", dtype=torch.bfloat16)
    for dtype, want in (("bfloat16", torch.bfloat16), ("float32", torch.float32)):
        program = load_program(path, dtype)
        engine = dcpgraph.compile(program, block_size=4, executor="emulated")
        weights = [t for t in engine.program.local_state(0) if t.dim() == 2]
        assert weights and all(t.dtype == want for t in weights)
    with LLM(model=path, block_size=4) as llm:
        assert llm.config.dtype == "bfloat16"


# -- clear errors, before any rank starts --------------------------------------------------------
def _rewrite_weights(path: str, edit) -> None:
    file = os.path.join(path, "model.safetensors")
    weights = load_file(file)
    edit(weights)
    save_file(weights, file, metadata={"format": "pt"})


def test_missing_unexpected_and_mismatched_tensors_are_named(tmp_path):
    path = save_tiny_checkpoint(tmp_path / "bad", "qwen3")
    check_checkpoint(path, "float32")
    _rewrite_weights(path, lambda w: w.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ConfigError, match=r"no tensor for \['model.layers.1.mlp.up_proj.weight'\]"):
        check_checkpoint(path, "float32")
    with pytest.raises(ConfigError, match="up_proj"):
        LLM(model=path, tensor_parallel_size=2)  # refused on the driver: no worker is started

    path = save_tiny_checkpoint(tmp_path / "extra", "qwen3")
    _rewrite_weights(path, lambda w: w.__setitem__("model.layers.9.stray.weight", torch.zeros(2)))
    with pytest.raises(ConfigError, match="does not have.*model.layers.9.stray.weight"):
        check_checkpoint(path, "float32")

    path = save_tiny_checkpoint(tmp_path / "shape", "qwen3")
    config = json.load(open(os.path.join(path, "config.json")))
    config["intermediate_size"] *= 2
    json.dump(config, open(os.path.join(path, "config.json"), "w"))
    with pytest.raises(ConfigError, match=r"mlp.gate_proj.weight: checkpoint .* \(128, 64\), model \(256, 64\)"):
        LLM(model=path)


def test_fused_experts_need_every_per_expert_tensor(tmp_path):
    path = save_tiny_checkpoint(tmp_path / "moe", "deepseek_v3")
    check_checkpoint(path, "float32")
    _rewrite_weights(path, lambda w: w.pop("model.layers.1.mlp.experts.2.up_proj.weight"))
    with pytest.raises(ConfigError, match=r"model.layers.1.mlp.experts.gate_up_proj.*per-expert"):
        check_checkpoint(path, "float32")


# -- a rank's peak memory while loading ----------------------------------------------------------
@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"),
                    reason="peak-RSS reset needs Linux /proc/self/clear_refs; run on Linux to measure")
@pytest.mark.slow  # ~10-20 s: kept out of the default tier's time budget
def test_a_rank_at_tp2_peaks_at_about_half_the_weights():
    """``benchmarks/loader_memory.py --quick``: each case a fresh process, peak-RSS growth while
    rank 0 reads (and touches) its state, against the checkpoint's weight bytes."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "loader_memory", os.path.join(os.path.dirname(__file__), "..", "benchmarks", "loader_memory.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.main(quick=True)
    tp1, tp2 = result["cases"]
    assert tp1["held_over_weights"] == pytest.approx(1.0, abs=0.01)
    assert tp2["held_over_weights"] == pytest.approx(0.5, abs=0.02)
    assert tp1["peak_growth_over_weights"] >= 0.9  # the measurement sees a whole load
    assert tp2["peak_growth_over_weights"] < 0.7, result  # half the weights plus what one read maps
    assert tp2["peak_growth_bytes"] < 0.65 * tp1["peak_growth_bytes"], result


def test_the_hf_export_helpers_are_public_and_keep_the_models_settings():
    """``LogitsForward`` is the exported signature (HF's logits for explicit positions),
    ``traceable_experts`` switches an eager MoE to ``batched_mm`` only while tracing, and
    ``export_program`` strips ``WRAPPER_PREFIX`` so state names are the checkpoint's."""
    from dcpgraph.frontends import hf
    from dcpgraph.testing.checkpoints import tiny_model

    model = tiny_model("qwen3", dtype=torch.float64)
    ids, positions = hf.default_example_inputs(hf.model_facts(model))
    with torch.no_grad():
        want = model(input_ids=ids, position_ids=positions).logits
        assert torch.equal(hf.LogitsForward(model)(ids, positions), want)
    model.train()
    program = hf.export_program(model, (ids, positions))
    assert model.training  # restored
    assert not any(name.startswith(hf.WRAPPER_PREFIX + hf.WRAPPER_PREFIX) for name in program.state)
    assert set(dict(model.named_parameters())) <= set(program.state)

    moe = tiny_model("deepseek_v2", dtype=torch.float64)
    moe.set_experts_implementation("eager")
    with hf.traceable_experts(moe):
        assert moe.config._experts_implementation == "batched_mm"
    assert moe.config._experts_implementation == "eager"
