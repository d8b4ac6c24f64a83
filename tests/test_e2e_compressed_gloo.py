"""DeepSeek-V4 on real ``gloo`` processes, one export per rank compiled twice: tp=2·dcp=1 over four
output groups (two heads and two groups per rank; the K=V head, compressor and indexer replicated,
10 blocks of 4) and tp=2·dcp=2 (the raw rows and entries sharded over both ranks, interleave 4,
CSA's candidates all-gathered and the partials exchanged over the DCP group; 4 blocks of 8
tokens). 5-token prefill chunks, and one request preempted and recomputed in each run. A third
compile, tp=2·dcp=2 with prefix caching (blocks of 4, interleave 1: virtual blocks of 8 tokens),
serves two prompts that hit a first one's cached blocks (16 and 8 tokens), their entries on the
ranks that own them and the open windows restored. Every rank returns the same greedy tokens,
equal to HF ``generate`` prompt by prompt."""

from __future__ import annotations

import dsv4_models
import pytest

from dcpgraph.runtime.distributed import spawn
from dcpgraph.testing.generation import hf_greedy

PROMPTS = [list(dsv4_models.PROMPTS[3]), [5, 9, 3, 17, 22, 40, 8, 1, 33, 12, 60], [1, 2, 3], [7]]
NEW_TOKENS = 8
BLOCK = 4
MESHES = {"dcp1": {"dcp": 1, "num_blocks": 10}, "dcp2": {"dcp": 2, "interleave": BLOCK, "num_blocks": 4}}
BASE = list(dsv4_models.PROMPTS[3])
PREFIX_PROMPTS = [BASE, BASE[:18] + [3, 99, 41, 8], BASE[:13] + [77, 2]]  # as test_compressed_prefix_cache


def _rank(rank: int, world: int):
    import dcpgraph
    from dcpgraph.testing.generation import drain

    program = dcpgraph.trace(dsv4_models.build(o_groups=4))
    out = {}
    for name, mesh in MESHES.items():
        engine = dcpgraph.compile(program, tp=world, executor="distributed", block_size=BLOCK,
                                  max_num_batched_tokens=5, **mesh)
        for prompt in PROMPTS:
            engine.add_request(prompt, max_new_tokens=NEW_TOKENS)
        got = drain(engine)
        out[name] = {"tokens": [got[i] for i in range(len(PROMPTS))], "report": engine.report(),
                     "preemptions": engine.scheduler.stats["preemptions"]}
    engine = dcpgraph.compile(program, tp=world, dcp=2, executor="distributed", block_size=BLOCK,
                              max_num_batched_tokens=8, enable_prefix_caching=True)
    first = engine.generate([PREFIX_PROMPTS[0]], NEW_TOKENS, ignore_eos=True)
    ids = [engine.add_request(p, max_new_tokens=NEW_TOKENS, ignore_eos=True) for p in PREFIX_PROMPTS[1:]]
    got = drain(engine)
    out["prefix"] = {"tokens": first + [got[i] for i in ids], "report": engine.prefix_cache_report(),
                     "restored": engine.scheduler.state_prefix.stats["restored"]}
    return out


@pytest.mark.gloo
@pytest.mark.slow  # each of the 2 ranks exports the V4 model (~30 s) on 2 loaded cores, then runs three meshes
def test_gloo_v4_tp2_at_dcp1_and_dcp2_generates_hf_tokens_through_chunks_and_a_preemption():
    results = spawn(_rank, 2, timeout_s=500)
    model = dsv4_models.build(o_groups=4)
    want = [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]
    want_prefix = [hf_greedy(model, p, NEW_TOKENS) for p in PREFIX_PROMPTS]
    for rank, by_mesh in enumerate(results):
        prefix = by_mesh.pop("prefix")
        assert prefix["tokens"] == want_prefix, f"rank {rank}, prefix caching at dcp2"
        assert prefix["report"]["hit_tokens"] == 16 + 8 and prefix["restored"] == 2, (rank, prefix)
        for name, result in by_mesh.items():
            assert result["report"]["executor"] == "distributed", (rank, name)
            assert result["preemptions"] >= 1, (rank, name)
            assert result["tokens"] == want, f"rank {rank}, {name}"
