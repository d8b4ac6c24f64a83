"""vLLM CPU's scheduler and cache defaults for ``LLM`` and ``dcpgraph serve``
(:mod:`dcpgraph.serving.vllm_defaults`): the formulas against vLLM's own figures
(``EngineArgs.get_batch_defaults`` on CPU, then its clamps with chunked prefill), the KV space
variable, the start-up line, and prefix caching decided on for a recurrent hybrid (with the reasons it is decided off)."""

from __future__ import annotations

import logging

import pytest

from dcpgraph.errors import ConfigError
from dcpgraph.serving import vllm_defaults
from dcpgraph.serving.vllm_defaults import resolve

GIB = 1 << 30


def _resolve(context="llm", *, tp=1, limit=32768, given_len=None, seqs=None, tokens=None, sized=False, on_host=True,
             environ=None):
    return resolve(context, tp=tp, model_limit=limit, max_model_len=given_len, max_num_seqs=seqs,
                   max_num_batched_tokens=tokens, sized=sized, on_host=on_host, environ=environ or {})


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize(("context", "tokens_per_rank", "seqs_per_rank"), [("llm", 4096, 256), ("serve", 2048, 128)])
def test_batch_defaults_scale_with_the_ranks_as_vllm_cpu(tp, context, tokens_per_rank, seqs_per_rank):
    d = _resolve(context, tp=tp)
    assert (d.max_model_len, d.max_num_seqs, d.max_num_batched_tokens) == (32768, seqs_per_rank * tp,
                                                                           tokens_per_rank * tp)
    assert set(d.defaulted) == {"max_model_len", "max_num_seqs", "max_num_batched_tokens"}


def test_a_short_model_clamps_the_token_budget_and_given_values_are_kept():
    # vLLM: max_num_batched_tokens = min(default, max_num_seqs * max_model_len), then
    # max_num_seqs = min(default, max_num_batched_tokens) when it was not given
    assert _resolve(limit=8).max_num_batched_tokens == 256 * 8 == 2048
    short = _resolve(limit=4, seqs=3)
    assert (short.max_num_seqs, short.max_num_batched_tokens) == (3, 12)
    small_budget = _resolve(tokens=64)
    assert (small_budget.max_num_seqs, small_budget.max_num_batched_tokens) == (64, 64)
    given = _resolve(given_len=100, seqs=8, tokens=256)
    assert (given.max_model_len, given.max_num_seqs, given.max_num_batched_tokens, given.defaulted) == (100, 8, 256, ())
    assert _resolve(limit=None).max_model_len == vllm_defaults.FALLBACK_MAX_MODEL_LEN
    with pytest.raises(ConfigError, match=r"usage_context must be one of \['llm', 'serve'\]"):
        _resolve("server")


def test_kv_cache_space_comes_from_the_environment_on_the_host_only():
    assert _resolve().kv_cache_space_bytes == 4 * GIB
    assert _resolve(environ={"VLLM_CPU_KVCACHE_SPACE": "2"}).kv_cache_space_bytes == 2 * GIB
    assert _resolve(environ={"VLLM_CPU_KVCACHE_SPACE": "0.5"}).kv_cache_space_bytes == GIB // 2
    assert _resolve(environ={"VLLM_CPU_KVCACHE_SPACE": ""}).kv_cache_space_bytes == 4 * GIB
    assert _resolve(sized=True).kv_cache_space_bytes is None  # a cache size or memory fraction given wins
    assert _resolve(on_host=False).kv_cache_space_bytes is None  # an accelerator: gpu_memory_utilization 0.9
    for bad in ("0", "-1", "four"):
        with pytest.raises(ConfigError, match=f"VLLM_CPU_KVCACHE_SPACE='{bad}': give the KV cache space per rank in GiB"):
            _resolve(environ={"VLLM_CPU_KVCACHE_SPACE": bad})


def test_llm_logs_the_figures_and_sizes_the_cache_from_the_space(tmp_path, monkeypatch, caplog):
    """A tiny Qwen3 (2 layers, one KV head of 16, fp32): a block of 16 tokens is
    2 layers x (K, V) x 16 x 16 x 4 bytes = 4 KiB, so 1 MiB of space is 256 blocks; without the
    variable 4 GiB would buy 2^20 blocks, more than 256 sequences of 2048 tokens take (32768)."""
    from dcpgraph import LLM
    from dcpgraph.testing.checkpoints import save_tiny_checkpoint

    path = save_tiny_checkpoint(tmp_path, "qwen3")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", str(1 / 1024))
    with caplog.at_level(logging.INFO, logger="dcpgraph.serving"):
        llm = LLM(path)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("vLLM CPU defaults"))
    assert line == ("vLLM CPU defaults (llm): max_model_len=2048 (default), max_num_seqs=256 (default), "
                    "max_num_batched_tokens=4096 (default), prefix caching on (default), KV cache 1.00 MiB per "
                    f"rank at most (VLLM_CPU_KVCACHE_SPACE={1 / 1024} GiB)")
    assert llm.num_kv_blocks() == 256
    assert llm.engine.report()["prefix_cache"]["enabled"] is True
    assert (llm.settings.scheduler.max_num_seqs, llm.settings.cache.enable_prefix_caching) == (256, True)
    llm.shutdown()


@pytest.mark.slow  # 16-24 s on two loaded cores (four compiles); the default tier sizes from the space in the LLM test
def test_the_space_is_capped_at_every_sequence_slot_at_full_length_without_prefix_caching():
    """compile's ``kv_cache_space_bytes`` (what LLM passes): at most the bytes' blocks, and without
    prefix caching no more than ``max_num_seqs`` sequences of ``max_model_len`` take; with prefix
    caching every block of the space (the blocks past the slots keep finished prompts' prefixes, as
    vLLM's space does); an explicit size is not capped.
    The tiny Qwen3 in float64: a 16-token block is 2 x 2 x 16 x 16 x 8 bytes = 8 KiB."""
    import torch

    import dcpgraph
    from dcpgraph.models import build_model

    model = dcpgraph.trace(build_model("qwen3", dtype=torch.float64))  # one trace, three configurations
    space = dcpgraph.compile(model, kv_cache_space_bytes=1 << 20, max_num_seqs=256, max_model_len=2048)
    assert space.blocks.num_blocks == (1 << 20) // (8 << 10) == 128
    capped = dcpgraph.compile(model, kv_cache_space_bytes=1 << 20, max_num_seqs=4, max_model_len=64)
    assert capped.blocks.num_blocks == 4 * 64 // 16
    cached = dcpgraph.compile(model, kv_cache_space_bytes=1 << 20, max_num_seqs=4, max_model_len=64,
                              enable_prefix_caching=True)
    assert cached.blocks.num_blocks == 128 and cached.blocks.enable_prefix_caching
    # ten 48-token prompts take 30 blocks, past the 16 of every slot at full length: the first
    # prompt's blocks are still cached when it comes back (a 16-block cache had evicted them); its
    # first two match (the last prompt token is always recomputed, so the third is not looked up)
    prompts = [[(7 * i + t) % 97 + 1 for t in range(48)] for i in range(10)]
    first = cached.generate(prompts, 1)
    assert cached.report()["prefix_cache"]["hit_tokens"] == 0
    assert cached.generate(prompts[:1], 1) == first[:1]
    assert cached.report()["prefix_cache"]["hit_tokens"] == 32
    explicit = dcpgraph.compile(model, kv_cache_space_bytes=1 << 20, num_blocks=500, max_num_seqs=4, max_model_len=64)
    assert explicit.blocks.num_blocks == 500


def test_prefix_caching_defaults_on_for_a_recurrent_hybrid(tmp_path, caplog):
    """LFM2 (short convolutions beside attention): vLLM's default is on, and a hybrid keeps its
    state at cached block boundaries, so compile decides it on and the start-up line says so."""
    from hybrid_models import MESH_MODELS

    from dcpgraph import LLM
    from dcpgraph.testing.checkpoints import tiny_tokenizer

    model = MESH_MODELS["lfm2"]()
    model.save_pretrained(tmp_path)
    tiny_tokenizer(model.config.vocab_size).save_pretrained(tmp_path)
    with caplog.at_level(logging.INFO, logger="dcpgraph.serving"):
        llm = LLM(str(tmp_path), dtype="float32", max_model_len=64)
    lines = [r.getMessage() for r in caplog.records if "prefix caching" in r.getMessage()]
    assert len(lines) == 1 and "prefix caching on (default)" in lines[0]
    report = llm.engine.report()["prefix_cache"]
    assert report["enabled"] is True and report["off_reason"] is None
    assert llm.settings.cache.enable_prefix_caching is True


def test_prefix_caching_default_names_why_it_is_off():
    """The reasons compile decides the default off: hybrid_kv_cache, and compressed (V4) layers whose
    compress rates do not divide block_size·dcp at dcp=1, or interleave·lcm(m) does not divide
    block_size at dcp > 1 (it stays on where they do)."""
    import types

    from dcpgraph.api import prefix_caching_refusal

    plain = types.SimpleNamespace(facts=types.SimpleNamespace(extra={}))
    assert prefix_caching_refusal(plain, {"hybrid_kv_cache": False}) is None
    assert prefix_caching_refusal(plain, {"hybrid_kv_cache": True}).startswith("hybrid_kv_cache")
    v4 = types.SimpleNamespace(facts=types.SimpleNamespace(extra={"compressed_layers": {0: "csa", 1: "hca"},
                                                                  "compress_rates": {0: 4, 1: 128}}))
    assert prefix_caching_refusal(v4, {"hybrid_kv_cache": False, "block_size": 16}).startswith(
        "compressed attention layers [0, 1]: block_size·dcp=16 is not a multiple of lcm of the compress rates [4, 128]")
    assert prefix_caching_refusal(v4, {"hybrid_kv_cache": False, "block_size": 128}) is None
    assert prefix_caching_refusal(v4, {"hybrid_kv_cache": False, "block_size": 64}, dcp=2).endswith(
        "(valid block_size: multiples of interleave·lcm = 128)")  # 64·2 tokens, but an entry row spans 128
    assert prefix_caching_refusal(v4, {"hybrid_kv_cache": False, "block_size": 128, "interleave": 1}, dcp=2) is None
    assert "interleave=2: each compress rate m in [4, 128] must divide block_size" in prefix_caching_refusal(
        v4, {"hybrid_kv_cache": False, "block_size": 128, "interleave": 2}, dcp=2)
