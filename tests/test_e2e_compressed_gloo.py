"""DeepSeek-V4 on real ``gloo`` processes: tp=2, dcp=1 over four output groups (two heads and two
groups per rank; the K=V head, compressor and indexer replicated), 5-token prefill chunks and 10
blocks of 4 so one request is preempted and recomputed. Every rank returns the same greedy tokens,
equal to HF ``generate`` prompt by prompt."""

from __future__ import annotations

import dsv4_models
import pytest

from dcpgraph.runtime.distributed import spawn
from dcpgraph.testing.generation import hf_greedy

PROMPTS = [list(dsv4_models.PROMPTS[3]), [5, 9, 3, 17, 22, 40, 8, 1, 33, 12, 60], [1, 2, 3], [7]]
NEW_TOKENS = 8
BLOCK = 4


def _rank(rank: int, world: int):
    import dcpgraph
    from dcpgraph.testing.generation import drain

    engine = dcpgraph.compile(dsv4_models.build(o_groups=4), tp=world, executor="distributed", block_size=BLOCK,
                              max_num_batched_tokens=5, num_blocks=10)
    for prompt in PROMPTS:
        engine.add_request(prompt, max_new_tokens=NEW_TOKENS)
    got = drain(engine)
    return {"tokens": [got[i] for i in range(len(PROMPTS))], "report": engine.report(),
            "preemptions": engine.scheduler.stats["preemptions"]}


@pytest.mark.gloo
@pytest.mark.slow  # each of the 2 ranks exports the V4 model (~30 s) on 2 loaded cores
def test_gloo_v4_tp2_generates_hf_tokens_through_chunks_and_a_preemption():
    results = spawn(_rank, 2, timeout_s=400)
    model = dsv4_models.build(o_groups=4)
    want = [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]
    for rank, result in enumerate(results):
        assert result["report"]["executor"] == "distributed", rank
        assert result["preemptions"] >= 1, rank
        assert result["tokens"] == want, f"rank {rank}"
