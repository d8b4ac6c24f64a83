"""DeepSeek-V3.2 sparse attention on real ``gloo`` processes: tp=2, dcp=2, a2a, interleave 1.

Each rank builds the same seeded model (:mod:`sfa_models`), compiles it (the distributed executor
is picked because ``torch.distributed`` is initialised with world size == tp) and generates; the
indexer's candidates and the attention partials cross processes through real collectives. Every
rank must return HF's greedy tokens and hold exactly its share of both caches.
"""

from __future__ import annotations

import pytest
import sfa_models

from dcpgraph import layout
from dcpgraph.runtime.distributed import spawn
from dcpgraph.testing.generation import hf_greedy

TP, DCP, INTERLEAVE, COMM, BLOCK, MAX_NEW = 2, 2, 1, "a2a", 4, 10


def _rank(rank: int, world: int):
    import dcpgraph

    model = sfa_models.build("deepseek_v32")
    engine = dcpgraph.compile(model, tp=world, dcp=DCP, interleave=INTERLEAVE, comm=COMM, block_size=BLOCK,
                              max_num_batched_tokens=8)
    tokens = engine.generate([list(p) for p in sfa_models.PROMPTS], MAX_NEW)
    written = {name: int((c.abs().sum(-1) > 0).sum()) for name, c in engine.executor.caches.items()}
    return {"tokens": tokens, "report": engine.report(), "written": written}


@pytest.mark.gloo
@pytest.mark.slow
def test_gloo_deepseek_v32_tp2_dcp2_matches_hf():
    results = spawn(_rank, TP, timeout_s=240)
    model = sfa_models.build("deepseek_v32")
    reference = [hf_greedy(model, p, MAX_NEW) for p in sfa_models.PROMPTS]
    for rank, result in enumerate(results):
        assert result["report"]["executor"] == "distributed" and result["report"]["comm"] == COMM
        assert result["tokens"] == reference, rank
        share = sum(layout.local_len(len(p) + len(out) - 1, rank % DCP, DCP, INTERLEAVE)
                    for p, out in zip(sfa_models.PROMPTS, result["tokens"]))
        assert sorted(result["written"]) == sorted(f"{k}_cache_{i}" for i in range(sfa_models.LAYERS)
                                                   for k in ("latent", "index"))
        assert all(n == share for n in result["written"].values()), (rank, result["written"], share)
