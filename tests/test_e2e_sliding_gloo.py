"""Sliding windows, soft-capping and sinks on real ``gloo`` processes: one spawn of 2 ranks per
model, tp=2, dcp=2 (each rank holds half of every request's context and bounds its window by its
own local shard). Gemma2 (soft-cap + alternating windows) with a2a, GPT-OSS (sinks + windows, MoE)
with ag_rs. Every rank returns the same tokens, equal to HF ``generate`` prompt by prompt.
"""

from __future__ import annotations

import pytest
from sliding_models import BLOCK, MAX_NEW, PROMPTS, build, compile_options

from dcpgraph.runtime.distributed import spawn
from dcpgraph.testing.generation import hf_greedy

CASES = {"gemma2": (2, "a2a"), "gpt_oss": (1, "ag_rs")}  # name: (interleave, comm)


def _rank(rank: int, world: int, name: str, interleave: int, comm: str):
    import dcpgraph

    engine = dcpgraph.compile(build(name), tp=world, dcp=2, interleave=interleave, comm=comm, block_size=BLOCK,
                              max_num_batched_tokens=8, **compile_options(name, world))
    return {"tokens": engine.generate([list(p) for p in PROMPTS], MAX_NEW), "report": engine.report()}


@pytest.mark.gloo
@pytest.mark.slow  # several gloo worlds compiling on 2 cores; the default tier keeps test_step_broadcast's
@pytest.mark.parametrize("name", sorted(CASES))
def test_gloo_sliding_models_generate_hf_tokens(name):
    interleave, comm = CASES[name]
    results = spawn(_rank, 2, name, interleave, comm, timeout_s=180)
    model = build(name)
    reference = [hf_greedy(model, p, MAX_NEW) for p in PROMPTS]
    for rank, result in enumerate(results):
        assert result["report"]["executor"] == "distributed", rank
        assert result["report"]["comm"] == comm
        assert result["tokens"] == reference, f"rank {rank}"
