"""DeepSeek-V4 end to end on the tiny model of ``tests/dsv4_models.py``: greedy tokens with every
attention layer's cache held by dcpgraph's compressed-attention ops (raw window and compressed
entries sharded over emulated DCP ranks, compressor open windows as per-request state, sharded
top-k for CSA) equal HF's own ``generate`` with its V4 cache, for prompts longer than the prefill
step, so steps cross window and entry boundaries; meshes tp·dcp with each DCP group attending for
its ranks' heads."""

from __future__ import annotations

import functools

import dsv4_models
import pytest

import dcpgraph
from dcpgraph.errors import ConfigError, UnsupportedModelError
from dcpgraph.ops.compressed_attention import dcp_group_heads

NEW_TOKENS = 8


@functools.cache
def _model():
    return dsv4_models.build()


@functools.cache
def _reference(prompt):
    return dsv4_models.hf_greedy(_model(), prompt, NEW_TOKENS)


def test_tiny_model_exercises_every_part():
    cfg = _model().config
    longest = max(len(p) for p in dsv4_models.PROMPTS) + NEW_TOKENS
    assert set(cfg.layer_types) == {"sliding_attention", "heavily_compressed_attention", "compressed_sparse_attention"}
    assert cfg.sliding_window < longest
    assert cfg.index_topk < longest // cfg.compress_rates["compressed_sparse_attention"]
    assert longest // cfg.compress_rates["heavily_compressed_attention"] >= 2
    assert set(cfg.mlp_layer_types) == {"hash_moe", "moe"}


@pytest.mark.parametrize(("chunk", "tp", "dcp", "interleave"), [(4, 1, 1, 1), (5, 2, 2, 1), (3, 4, 4, 2)])
@pytest.mark.parametrize("prompt", dsv4_models.PROMPTS[2:], ids=lambda p: f"len{len(p)}")
def test_greedy_matches_hf_generate(prompt, chunk, tp, dcp, interleave):
    got = dsv4_models.sharded_greedy(_model(), prompt, NEW_TOKENS, chunk=chunk, tp=tp, dcp=dcp, interleave=interleave)
    assert got == _reference(prompt)


@pytest.mark.slow
@pytest.mark.parametrize(("chunk", "tp", "dcp", "interleave"),
                         [(1, 1, 1, 1), (2, 2, 1, 1), (64, 2, 2, 2), (8, 4, 1, 1), (7, 4, 2, 1), (3, 4, 2, 2),
                          (6, 4, 4, 1)])
@pytest.mark.parametrize("prompt", dsv4_models.PROMPTS, ids=lambda p: f"len{len(p)}")
def test_greedy_matches_hf_generate_more_meshes(prompt, chunk, tp, dcp, interleave):
    got = dsv4_models.sharded_greedy(_model(), prompt, NEW_TOKENS, chunk=chunk, tp=tp, dcp=dcp, interleave=interleave)
    assert got == _reference(prompt)


def test_fp32_greedy_matches_hf_generate():
    """The same weights in fp32 (HF keeps its fp32 softmaxes; dcpgraph accumulates in fp32)."""
    import copy

    import torch

    model = copy.deepcopy(_model()).to(torch.float32)
    prompt = dsv4_models.PROMPTS[3]
    expected = dsv4_models.hf_greedy(model, prompt, NEW_TOKENS)
    assert dsv4_models.sharded_greedy(model, prompt, NEW_TOKENS, chunk=5, tp=2, dcp=2) == expected


def test_mesh_rule_is_named():
    assert dcp_group_heads(4, 4, 2) == [range(0, 2), range(2, 4)]
    with pytest.raises(ConfigError, match=r"tp % dcp == 0; valid tp for dcp=2: \[2, 4\]"):
        dcp_group_heads(4, 1, 2)
    with pytest.raises(ConfigError, match=r"num_heads \(4\) % tp == 0"):
        dcp_group_heads(4, 3, 3)
    with pytest.raises(ConfigError, match="positive ints"):
        dcp_group_heads(4, 2, 0)


@pytest.mark.parametrize(("options", "named"), [
    ({"tp": 4, "pcp": 2}, r"tp=4 \(tp must divide o_groups=2"),
    ({"tp": 4}, r"tp=4 \(tp must divide o_groups=2"),
    ({"enable_prefix_caching": True, "block_size": 6}, r"enable_prefix_caching=True with block_size·dcp=6"),
])
def test_compiling_v4_with_what_its_cached_layer_lacks_is_refused_by_name(options, named):
    """The cached layer compiles at tp dividing o_groups and dcp dividing tp·pcp
    (``test_compile_compressed``, ``test_compile_compressed_dcp``, ``test_pcp_compressed``, the raw
    window in the sliding group at any dcp); a tp not dividing o_groups (with pcp too) and the
    features it does not keep state for are refused by name, before any trace or pass."""
    with pytest.raises(UnsupportedModelError, match=r"DeepSeek-V4 compressed attention \(CSA/HCA\) at layers "
                       r"\[1, 2, 3\]: dcpgraph.compile does not support .*" + named
                       + r".*Supported: tp dividing o_groups, dcp dividing tp·pcp"):
        dcpgraph.compile(_model(), **options)


def test_speculation_other_than_ngram_and_mtp_is_refused_by_name():
    """ngram and MTP run (``test_compressed_speculative``, ``test_mtp_v4``); a draft model is
    refused before any trace."""
    from dcpgraph.frontends.compressed_layers import refuse_compiling_compressed_layers

    with pytest.raises(UnsupportedModelError, match=r"does not support speculative_config method='draft_model' "
                                                     r"\(only 'ngram' and 'mtp'"):
        refuse_compiling_compressed_layers(_model(), opts={"speculative_config": {"method": "draft_model"}})
    for method in ("ngram", "mtp"):
        refuse_compiling_compressed_layers(_model(), opts={"speculative_config": {"method": method}})
