"""Prefill context parallel (PCP): the mesh, the zigzag split, the per-rank attention against
dense causal attention, and greedy generation after an emulated PCP prefill against HF ``generate``.

Models: tiny random fp64 Llama (1 KV head) and Qwen3 (2 KV heads, q/k norms), 2 layers, so that
exchange/merge rounding cannot flip an argmax. Meshes: the acceptance list (tp, pcp, dcp) in
{(1,2,1), (1,2,2), (2,2,1), (2,2,2), (2,2,4), (1,4,2)} where valid ((2,2,4) needs 1 KV head).
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from pcp_models import matches_hf, pcp_config, pcp_model

import dcpgraph
from dcpgraph import ConfigError, Mesh
from dcpgraph.config import DcpgraphConfig
from dcpgraph.ops.kernels import attend
from dcpgraph.pcp.attention import in_prompt_order, merge_partials, new_token_attention
from dcpgraph.pcp.generate import generate_greedy
from dcpgraph.pcp.split import causal_work, chunk_bounds, rank_chunks, rank_token_indices


# -- mesh -----------------------------------------------------------------------------------------
def test_pcp_adds_ranks_and_dcp_groups_span_the_pcp_axis_first():
    mesh = Mesh(tp=2, dcp=4, pcp=2)
    assert mesh.world_size == 4 and list(mesh.ranks) == [0, 1, 2, 3]
    assert [mesh.tp_group(r) for r in mesh.ranks] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    assert [mesh.pcp_group(r) for r in mesh.ranks] == [(0, 2), (1, 3), (0, 2), (1, 3)]
    assert mesh.dcp_groups() == [(0, 2, 1, 3)]  # attention order t·pcp + p
    assert Mesh(tp=2, dcp=2, pcp=2).dcp_groups() == [(0, 2), (1, 3)]  # each inside one TP rank's heads
    assert Mesh(tp=8, dcp=2).dcp_groups() == [(0, 1), (2, 3), (4, 5), (6, 7)]  # pcp=1 unchanged


@pytest.mark.parametrize("tp, pcp, dcp, kv", [(1, 2, 1, 2), (1, 2, 2, 2), (2, 2, 1, 2), (2, 2, 2, 2),
                                               (2, 2, 4, 1), (1, 4, 2, 2), (1, 4, 4, 8)])
def test_acceptance_meshes_validate(tp, pcp, dcp, kv):
    mesh = Mesh(tp=tp, dcp=dcp, pcp=pcp)
    assert mesh.validate(attention="gqa", num_q_heads=8, num_kv_heads=kv) is mesh
    for group in mesh.dcp_groups():  # a DCP group shares one KV head: same TP replica set
        assert len({mesh.tp_rank(r) * kv // tp if tp > kv else mesh.tp_rank(r) for r in group}) == 1


def test_compile_validates_the_pcp_mesh_before_anything_runs():
    model = tf.LlamaForCausalLM(pcp_config(tf.LlamaConfig, kv=1))
    with pytest.raises(ConfigError, match=r"\(tp · pcp\) % dcp|max\(tp // num_kv_heads, 1\) · pcp"):
        dcpgraph.compile(model, tp=1, pcp=2, dcp=4)


def test_pcp_is_a_config_field_with_vllms_spelling():
    settings = DcpgraphConfig.from_compile_options(tp=2, pcp=2, dcp=4)
    assert settings.parallel.prefill_context_parallel_size == 2
    assert DcpgraphConfig.from_llm_kwargs(prefill_context_parallel_size=2).parallel.prefill_context_parallel_size == 2
    with pytest.raises(ConfigError, match="pcp must be a positive int"):
        DcpgraphConfig.from_compile_options(pcp=0)


# -- the split ------------------------------------------------------------------------------------
@pytest.mark.parametrize("n, pcp", [(0, 2), (1, 2), (3, 2), (7, 4), (16, 2), (37, 4), (100, 2)])
def test_zigzag_split_covers_every_token_once(n, pcp):
    bounds = chunk_bounds(n, pcp)
    assert len(bounds) == 2 * pcp and bounds[0][0] == 0 and bounds[-1][1] == n
    assert max(e - s for s, e in bounds) - min(e - s for s, e in bounds) <= 1
    every = sorted(i for r in range(pcp) for i in rank_token_indices(n, pcp, r))
    assert every == list(range(n))
    assert rank_chunks(n, pcp, 0) == (bounds[0], bounds[-1])


@pytest.mark.parametrize("n, pcp", [(16, 2), (64, 4), (96, 2)])
def test_zigzag_balances_causal_work_exactly_when_n_divides(n, pcp):
    works = [causal_work(n, pcp, r) for r in range(pcp)]
    assert works == [n * (n + 1) // (2 * pcp)] * pcp
    contiguous = [sum(i + 1 for i in range(r * n // pcp, (r + 1) * n // pcp)) for r in range(pcp)]
    assert max(works) < max(contiguous)  # a plain split leaves the last rank most of the work


# -- attention: a hand-written loop over ranks against dense causal attention ---------------------
@pytest.mark.parametrize("n, cached, pcp", [(1, 0, 2), (9, 0, 2), (9, 5, 2), (23, 11, 4)])
def test_rank_attention_merged_equals_dense_causal(n, cached, pcp):
    g = torch.Generator().manual_seed(n * 31 + cached)
    hq, hkv, d = 4, 2, 8
    q = torch.randn(n, hq, d, generator=g, dtype=torch.float64)
    k = torch.randn(cached + n, hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(cached + n, hkv, d, generator=g, dtype=torch.float64)
    dense, _ = attend(q, k, v, 0.3, causal=True)  # bottom-right: new token i sees cached + i + 1 keys
    pieces = [k[cached:][rank_token_indices(n, pcp, r)] for r in range(pcp)]
    assert torch.equal(in_prompt_order(pieces, n, pcp), k[cached:])
    for r in range(pcp):
        rows = rank_token_indices(n, pcp, r)
        partials = [new_token_attention(q[rows], k[cached:], v[cached:], rank_chunks(n, pcp, r), 0.3)]
        if cached:
            partials.append(attend(q[rows], k[:cached], v[:cached], 0.3))
        out, _ = merge_partials(partials)
        torch.testing.assert_close(out, dense[rows], rtol=1e-12, atol=1e-12)


# -- end to end: greedy tokens against HF generate -------------------------------------------------
GREEDY_CASES = [(name, *mesh) for name in ("llama", "qwen3")
                for mesh in [(1, 2, 1), (1, 2, 2), (2, 2, 1), (2, 2, 2), (2, 2, 4), (1, 4, 2)]
                if not (name == "qwen3" and mesh == (2, 2, 4))]  # 2 KV heads: each on 2 attention ranks


@pytest.mark.parametrize("name, tp, pcp, dcp", GREEDY_CASES)
def test_greedy_tokens_match_hf_generate(name, tp, pcp, dcp):
    model = pcp_model(name)
    mesh = Mesh(tp=tp, dcp=dcp, pcp=pcp)
    g = torch.Generator().manual_seed(3)
    for length, chunk, interleave in [(1, None, 1), (6, 4, 2), (45, 8, 1), (101, 32, 4)]:
        prompt = torch.randint(0, 128, (length,), generator=g).tolist()
        tokens, caches = generate_greedy(model, mesh, prompt, 8, prefill_chunk=chunk, interleave=interleave)
        assert matches_hf(model, prompt, tokens), (length, chunk, interleave)
        for rank, cache in caches.items():  # each rank stores exactly the positions it owns
            owned = [x for x in range(length + 7) if (x // interleave) % dcp == mesh.dcp_rank(rank)]
            assert cache.positions[0].tolist() == owned


@pytest.mark.parametrize("pcp, dcp", [(2, 2), (4, 2)])
def test_prefix_reuse_then_pcp_prefillmatches_hf(pcp, dcp):
    model, mesh = pcp_model("qwen3"), Mesh(tp=1, dcp=dcp, pcp=pcp)
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(0, 128, (24,), generator=g).tolist()
    first = shared + torch.randint(0, 128, (9,), generator=g).tolist()
    second = shared + torch.randint(0, 128, (14,), generator=g).tolist()
    _, caches = generate_greedy(model, mesh, first, 2, prefill_chunk=7)
    reused = {r: c.truncated(len(shared)) for r, c in caches.items()}
    tokens, _ = generate_greedy(model, mesh, second, 6, reused=reused, reused_len=len(shared), prefill_chunk=5)
    assert matches_hf(model, second, tokens)


def test_eager_path_refuses_what_it_does_not_run():
    with pytest.raises(ConfigError, match=r"max\(tp // num_kv_heads, 1\) · pcp"):
        generate_greedy(pcp_model("qwen3"), Mesh(tp=2, dcp=4, pcp=2), [1, 2, 3], 1)
    gemma = tf.Gemma2ForCausalLM(tf.Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                 num_hidden_layers=1, num_attention_heads=2,
                                                 num_key_value_heads=1, head_dim=16))
    with pytest.raises(dcpgraph.UnsupportedModelError, match=r"supports \['llama', 'qwen3'\]"):
        generate_greedy(gemma, Mesh(tp=1, dcp=1, pcp=2), [1, 2, 3], 1)
    for bad in (dict(prompt=[]), dict(max_new_tokens=0), dict(prefill_chunk=0)):
        args = {"prompt": [1, 2, 3], "max_new_tokens": 1, **bad}
        with pytest.raises(ConfigError, match="non-empty prompt, max_new_tokens >= 1"):
            generate_greedy(pcp_model("llama"), Mesh(tp=1, dcp=1, pcp=2), **args)
    with pytest.raises(ConfigError, match=r"reused_len must be in \[0, 3\)"):
        generate_greedy(pcp_model("llama"), Mesh(tp=1, dcp=1, pcp=2), [1, 2, 3], 1, reused_len=3)


def test_serve_flags_and_llm_take_pcp_and_refuse_what_it_does_not_run_before_any_rank_starts(tmp_path):
    import argparse

    from dcpgraph.serving.cli_args import add_cli_args
    from dcpgraph.serving.llm import LLM
    from dcpgraph.testing.checkpoints import save_tiny_checkpoint

    parser = add_cli_args(argparse.ArgumentParser())
    for flags in (["-pcp", "2"], ["--prefill-context-parallel-size", "2"]):
        args = parser.parse_args(["/m", *flags, "-dcp", "2"])
        assert DcpgraphConfig.from_cli_args(args).parallel.prefill_context_parallel_size == 2
    path = save_tiny_checkpoint(tmp_path / "m", "qwen3", layers=1)
    with pytest.raises(ConfigError, match=r"\(tp · pcp\) % dcp == 0 failed.*valid dcp: \[1, 2\]"):
        LLM(path, prefill_context_parallel_size=2, decode_context_parallel_size=4)
    with pytest.raises(ConfigError, match="prefill_context_parallel_size=2 .*does not run in LLM / dcpgraph serve "
                                          "with data_parallel_size=2"):
        LLM(path, prefill_context_parallel_size=2, decode_context_parallel_size=2, data_parallel_size=2)


# -- planner: the TTFT estimate --------------------------------------------------------------------
def test_prefill_estimate_splits_work_by_pcp_and_charges_the_exchange():
    from dcpgraph.plan.hardware import PRESETS
    from dcpgraph.plan.model_shape import from_config
    from dcpgraph.plan.prefill_cost import prefill_estimate

    shape = from_config({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 8,
                         "hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
                         "intermediate_size": 1408, "vocab_size": 1024, "torch_dtype": "bfloat16"})
    hw = PRESETS["h200"]
    one, two = (prefill_estimate(shape, hw, tp=1, pcp=p, prompt_tokens=8192) for p in (1, 2))
    assert two.tokens_per_rank == 4096 and two.dense_flops == one.dense_flops / 2
    assert two.attention_flops == one.attention_flops / 2 == 4 * 8 * 64 * 8192 * 8193 // 4 * 8
    assert one.exchange_bytes == 0 and two.exchange_bytes == 8192 / 2 * 2 * 2 * 64 * 2 * 8
    assert two.exchange_s > 0 and two.ttft_s < 0.65 * one.ttft_s
