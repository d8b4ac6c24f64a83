"""The compiled engine with pcp > 1 (split_pcp_prefill): greedy tokens against HF ``generate``.

Tiny Llama (1 KV head) and Qwen3 (2 KV heads) in float64 (transformers' classes, weights initialised at 0.2); every case
prefills in small forced chunks (``max_num_batched_tokens``), so long prompts are split over the
PCP ranks chunk by chunk after a cached context, and several requests share a step.
"""

from __future__ import annotations

import pytest
import torch
from pcp_models import pcp_model

import dcpgraph
from dcpgraph.errors import ConfigError
from dcpgraph.pcp.split import rank_token_indices
from dcpgraph.pcp.step_rows import pcp_step_rows
from dcpgraph.testing.checkpoints import tiny_model


def _hf(model, prompt: list[int], n: int) -> list[int]:
    return model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)[0, len(prompt):].tolist()


def _prompts(seed: int, lengths) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (n,), generator=g).tolist() for n in lengths]


def test_step_rows_cover_every_token_once_in_zigzag_order():
    counts = [1, 6, 11]
    rows, order, cu = pcp_step_rows(counts, 2)
    assert len({r.numel() for r in rows}) == 1  # one shape over the PCP group
    starts = [0, 1, 7]
    for p, mine in enumerate(rows):
        real = [s + i for s, n in zip(starts, counts) for i in rank_token_indices(n, 2, p)]
        assert mine[:len(real)].tolist() == real and set(mine[len(real):].tolist()) <= {0}
        assert cu[p].tolist()[:-1] == [0, *[sum(1 for x in real if x < s + n) for s, n in zip(starts, counts)][:-1]]
        assert cu[p][-1] == mine.numel()
    gathered = torch.cat(rows)
    assert gathered[order].tolist() == list(range(sum(counts)))


def test_compiled_pcp_matches_hf_with_chunks_interleave_and_prefix_cache():
    model = pcp_model("qwen3")
    engine = dcpgraph.compile(model, tp=1, pcp=2, dcp=2, interleave=2, max_num_batched_tokens=12,
                              enable_prefix_caching=True, backend="eager")
    graph = engine.program.graph_module.graph
    gathers = [n for n in graph.nodes if n.op == "call_function" and "all_gather" in str(n.target)
               and "dcpgraph.pcp" in n.args]
    assert len(gathers) == 3 * 2 + 1  # q, k, v of both layers and the LM head's input: the step is split
    assert {"pcp_rows", "pcp_order"} <= {s.name for s in engine.program.inputs}
    shared = _prompts(11, [33])[0]
    first, second, short = shared + [5, 9, 3], shared + [7, 1, 2, 8, 4, 6], [17]
    assert engine.generate([first, short], 3) == [_hf(model, first, 3), _hf(model, short, 3)]
    assert engine.generate([second], 3) == [_hf(model, second, 3)]
    report = engine.report()["prefix_cache"]
    assert report["hit_tokens"] >= 32  # the shared prefix's full virtual blocks (16·dcp = 32 tokens) were read


MESHES = [(1, 2, 1), (1, 2, 2), (2, 2, 1), (2, 2, 2), (2, 2, 4), (1, 4, 2)]


@pytest.mark.slow  # 11 compiles of a 2-layer model and ~100 emulated steps each: ~10 s a case on 2 loaded cores
@pytest.mark.parametrize("name, tp, pcp, dcp", [(n, *m) for n in ("llama", "qwen3") for m in MESHES
                                                  if not (n == "qwen3" and m == (2, 2, 4))])
def test_compiled_pcp_matches_hf_on_every_acceptance_mesh(name, tp, pcp, dcp):
    model = pcp_model(name)
    engine = dcpgraph.compile(model, tp=tp, pcp=pcp, dcp=dcp, max_num_batched_tokens=16,
                              enable_prefix_caching=True, backend="eager")
    # dcp = 1: each rank attends its own rows; 1 < dcp < pcp: its DCP group's rows; else the whole step
    assert ("split_pcp_attention" in engine.program.passes_run()) == (dcp == 1 or dcp < pcp)
    prompts = _prompts(3, [1, 6, 45, 101])
    assert engine.generate(prompts, 6) == [_hf(model, p, 6) for p in prompts]
    again = prompts[3][:64] + [1, 2, 3]  # a prefix-cache hit on the 101-token prompt's blocks
    assert engine.generate([again], 6) == [_hf(model, again, 6)]
    assert engine.report()["prefix_cache"]["hit_tokens"] > 0


@pytest.mark.slow  # DeepSeek-V2 (MoE) compiles and HF generate: ~8 s a case on 2 loaded cores
@pytest.mark.parametrize("tp, pcp, dcp", [(1, 2, 1), (1, 2, 2), (2, 2, 4), (1, 4, 2)])
def test_compiled_pcp_mla_matches_hf(tp, pcp, dcp):
    model = tiny_model("deepseek_v2", layers=2)  # float32: HF's grouped MoE matmul takes no float64
    engine = dcpgraph.compile(model, tp=tp, pcp=pcp, dcp=dcp, max_num_batched_tokens=8, backend="eager")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 200, (n,), generator=g).tolist() for n in (1, 6, 45)]
    assert engine.generate(prompts, 6) == [_hf(model, p, 6) for p in prompts]


@pytest.mark.slow  # a compile and ~20 emulated verify steps against HF: ~10-15 s on 2 loaded cores
def test_compiled_pcp_ngram_speculation_matches_hf_with_local_queries():
    model = pcp_model("qwen3")
    engine = dcpgraph.compile(model, tp=1, pcp=2, dcp=1, max_num_batched_tokens=12, backend="eager",
                              speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                  "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    repeat = [1, 2, 3, 4, 5] * 2 + [1, 2, 3]
    prompts = [repeat, _prompts(11, [20])[0] + repeat]
    assert engine.generate(prompts, 8) == [_hf(model, p, 8) for p in prompts]
    spec = engine.report()["speculative"]
    assert spec["drafted"] > spec["accepted"] > 0  # verify steps that kept drafts and ones that dropped some


def test_compiled_pcp_refuses_what_it_does_not_run_by_name():
    model = pcp_model("llama")
    with pytest.raises(ConfigError, match=r"prefill_context_parallel_size=2 .*with hybrid_kv_cache.*runs for GQA"):
        dcpgraph.compile(model, tp=1, pcp=2, dcp=1, hybrid_kv_cache=True)
    with pytest.raises(ConfigError, match=r"comm='ag' is not supported with prefill_context_parallel_size=2"):
        dcpgraph.compile(model, tp=1, pcp=2, dcp=2, comm="ag", backend="eager")


def test_compiled_pcp_from_a_checkpoint_reads_every_replica_its_tp_shard(checkpoints):
    """A Program loaded from a checkpoint (what LLM and serve compile) reads rank ``r``'s slices
    for its TP rank ``r mod tp``: at (2,2,1) ranks 2 and 3 hold ranks 0 and 1's shards, and the
    greedy tokens equal HF's."""
    from dcpgraph.checkpoints.loader import load_program
    from dcpgraph.checkpoints.model_dir import load_model
    from dcpgraph.testing.generation import hf_greedy

    path = checkpoints["qwen3"]
    engine = dcpgraph.compile(load_program(path, "float64"), tp=2, pcp=2, dcp=1, block_size=4,
                              max_num_batched_tokens=8, capture_limit=0, backend="eager")
    states = engine.executor.states
    for rank in (2, 3):
        assert all(torch.equal(a, b) for a, b in zip(states[rank], states[rank - 2]))
    assert not all(torch.equal(a, b) for a, b in zip(states[0], states[1]))  # TP shards differ
    hf = load_model(path, "float64")
    prompts = [[5, 9, 4, 77, 30, 31, 32, 33, 34, 35, 36], [7]]
    assert engine.generate(prompts, 4) == [hf_greedy(hf, p, 4) for p in prompts]


def _gloo_rank(rank: int, world: int, dcp: int, prompts: list[list[int]]):
    model = pcp_model("qwen3")
    engine = dcpgraph.compile(model, tp=1, pcp=2, dcp=dcp, max_num_batched_tokens=8, enable_prefix_caching=True,
                              backend="eager")
    first = engine.generate(prompts, 5)
    again = engine.generate([prompts[-1][:40] + [3, 1]], 5)
    return {"executor": engine.executor.mode, "tokens": first + again,
            "hits": engine.report()["prefix_cache"]["hit_tokens"]}


@pytest.mark.gloo
@pytest.mark.slow  # two gloo processes each compiling and generating: ~15-30 s a case on 2 loaded cores
@pytest.mark.parametrize("dcp", [1, 2])  # local queries (split_pcp_attention); gathered queries + DCP
def test_compiled_pcp_on_gloo_processes_matches_hf(dcp):
    from dcpgraph.runtime.distributed import spawn

    prompts = _prompts(9, [1, 7, 45])
    results = spawn(_gloo_rank, 2, dcp, prompts, timeout_s=240)
    model = pcp_model("qwen3")
    reference = [_hf(model, p, 5) for p in prompts] + [_hf(model, prompts[-1][:40] + [3, 1], 5)]
    for result in results:
        assert result["executor"] == "distributed"
        assert result["tokens"] == reference
        assert result["hits"] >= 16 * dcp


def test_paged_read_of_zigzag_rows_takes_causal_runs_and_equals_the_masked_read():
    from dcpgraph.ops.kernels import attend
    from dcpgraph.ops.paged import causal_runs, paged_partial_attention

    g = torch.Generator().manual_seed(0)
    block, keys = 4, 17
    k_cache, v_cache = torch.randn(6, block, 1, 8, generator=g, dtype=torch.float64), \
        torch.randn(6, block, 1, 8, generator=g, dtype=torch.float64)
    table = torch.tensor([[3, 0, 5, 1, 2]], dtype=torch.int32)
    bound = torch.tensor([6, 7, 8, 15, 16, 17, 6])  # chunks [5, 8) and [14, 17) after 5 cached, one pad row
    assert causal_runs(bound, keys) == [(0, 3, 8), (3, 6, 17), (6, 7, 6)]
    q = torch.randn(7, 2, 8, generator=g, dtype=torch.float64)
    out, lse = paged_partial_attention(q, k_cache, v_cache, table, torch.tensor([0, 7], dtype=torch.int32),
                                       torch.tensor([keys], dtype=torch.int32), bound, 0.3)
    k = k_cache[table[0].long()].reshape(-1, 1, 8)[:keys]
    v = v_cache[table[0].long()].reshape(-1, 1, 8)[:keys]
    ref, ref_lse = attend(q, k, v, 0.3, kv_bound=bound)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-12)
