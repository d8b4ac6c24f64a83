"""DeepSeek-V4 on real ``gloo`` processes, one export per rank compiled twice: tp=2·dcp=1 over four
output groups (two heads and two groups per rank; the K=V head, compressor and indexer replicated,
10 blocks of 4) and tp=2·dcp=2 (the raw rows and entries sharded over both ranks, interleave 4,
CSA's candidates all-gathered and the partials exchanged over the DCP group; 4 blocks of 8
tokens). 5-token prefill chunks, and one request preempted and recomputed in each run. Every rank
returns the same greedy tokens, equal to HF ``generate`` prompt by prompt."""

from __future__ import annotations

import dsv4_models
import pytest

from dcpgraph.runtime.distributed import spawn
from dcpgraph.testing.generation import hf_greedy

PROMPTS = [list(dsv4_models.PROMPTS[3]), [5, 9, 3, 17, 22, 40, 8, 1, 33, 12, 60], [1, 2, 3], [7]]
NEW_TOKENS = 8
BLOCK = 4
MESHES = {"dcp1": {"dcp": 1, "num_blocks": 10}, "dcp2": {"dcp": 2, "interleave": BLOCK, "num_blocks": 4}}


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
    return out


@pytest.mark.gloo
@pytest.mark.slow  # each of the 2 ranks exports the V4 model (~30 s) on 2 loaded cores, then runs two meshes
def test_gloo_v4_tp2_at_dcp1_and_dcp2_generates_hf_tokens_through_chunks_and_a_preemption():
    results = spawn(_rank, 2, timeout_s=500)
    model = dsv4_models.build(o_groups=4)
    want = [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]
    for rank, by_mesh in enumerate(results):
        for name, result in by_mesh.items():
            assert result["report"]["executor"] == "distributed", (rank, name)
            assert result["preemptions"] >= 1, (rank, name)
            assert result["tokens"] == want, f"rank {rank}, {name}"
