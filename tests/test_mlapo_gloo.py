"""MLAPO on real ``gloo`` processes (the fused MLA preprocess): DeepSeek-V2 tiny (``q_proj``, complex
rotary), tp=2, dcp=2, interleave 1, ``a2a``, one spawn.

Each rank compiles the seeded model with ``mlapo=True`` (the distributed executor, since
``torch.distributed`` is initialised with world size == tp) and must hold one ``mla_preprocess`` per
layer and no separate cache write, return the same tokens as every other rank, equal to HF
``generate`` prompt by prompt, and hold exactly its share of the latent KV (the op writes only the
slots this DCP rank owns).
"""

from __future__ import annotations

import pytest
from mla_models import BLOCK_SIZE, LAYERS, MAX_BATCHED, MAX_NEW, PROMPTS, build, hf_greedy

from dcpgraph import layout
from dcpgraph.runtime.distributed import spawn

NAME = "deepseek_v2"
TP, DCP, INTERLEAVE, COMM = 2, 2, 1, "a2a"


def _rank(rank: int, world: int, name: str):
    import torch

    import dcpgraph

    engine = dcpgraph.compile(build(name), tp=world, dcp=DCP, interleave=INTERLEAVE, comm=COMM,
                              block_size=BLOCK_SIZE, max_num_batched_tokens=MAX_BATCHED, mlapo=True)
    graph = engine.program.graph_module.graph
    ops = torch.ops.dcpgraph
    counts = {op: sum(1 for n in graph.nodes if n.target is getattr(ops, op).default)
              for op in ("mla_preprocess", "kv_cache_write_")}
    tokens = engine.generate([list(p) for p in PROMPTS], MAX_NEW)
    written = sum(int((c.abs().sum(-1) > 0).sum()) for c in engine.executor.caches.values())
    return {"counts": counts, "tokens": tokens, "executor": engine.report()["executor"], "written": written}


@pytest.mark.gloo
@pytest.mark.slow
def test_gloo_deepseek_v2_mlapo_tp2_dcp2_matches_hf():
    results = spawn(_rank, TP, NAME, timeout_s=180)
    model = build(NAME)
    reference = [hf_greedy(model, p, MAX_NEW) for p in PROMPTS]
    for rank, result in enumerate(results):
        assert result["executor"] == "distributed", rank
        assert result["counts"] == {"mla_preprocess": LAYERS, "kv_cache_write_": 0}, rank
        for prompt, got, want in zip(PROMPTS, result["tokens"], reference):
            assert got == want, f"rank {rank}, prompt of length {len(prompt)}"
        share = sum(layout.local_len(len(p) + len(out) - 1, rank % DCP, DCP, INTERLEAVE)
                    for p, out in zip(PROMPTS, result["tokens"]))
        assert result["written"] == LAYERS * share, rank
