"""End-to-end on real ``gloo`` processes: every rank compiles the same HF model and generates.

Two spawns (each ~5–15 s on 2 cores):

* world 2: the Llama model of ``test_e2e_gqa`` (1 KV head) at tp=2, dcp=2, interleave 2, a2a;
* world 4: the Qwen3 model (q/k norm, 2 KV heads) at tp=4, dcp=2, interleave 4, ag_rs, so the two
  DCP groups {0,1} and {2,3} each shard a different KV head.

Each rank builds the model deterministically (seeded, :func:`test_e2e_gqa.build_model`), first
checks that invalid configurations raise ``ConfigError`` locally (if one rank did not raise it
would enter a collective its peers never reach, and the spawn would time out instead of passing),
then calls ``dcpgraph.compile(model, ...)``, which picks the distributed executor because
``torch.distributed`` is initialised with world size == tp. Every rank must return the same
tokens, equal to HF ``generate(do_sample=False)`` prompt by prompt.
"""

from __future__ import annotations

import pytest
from gqa_models import BLOCK_SIZE, MAX_BATCHED, PROMPTS, build_model, hf_greedy

from dcpgraph.runtime.distributed import spawn

MAX_NEW = 20

CASES = {
    # world: (model, dcp, interleave, comm, invalid configurations to try first)
    2: ("llama", 2, 2, "a2a", [
        dict(tp=2, dcp=4),  # tp % dcp
        dict(tp=4, dcp=2, executor="distributed"),  # world size 2 != tp
        dict(tp=2, dcp=2, interleave=3),  # block_size % interleave
    ]),
    4: ("qwen3", 2, BLOCK_SIZE, "ag_rs", [
        dict(tp=4, dcp=4),  # only 4 // 2 = 2 replicas of each KV head
        dict(tp=2, dcp=2, executor="distributed"),  # tp <= num_kv_heads (and world size 4 != 2)
    ]),
}


def _rank(rank: int, world: int, name: str, dcp: int, interleave: int, comm: str, invalid: list[dict]):
    import torch.distributed as dist

    import dcpgraph

    model = build_model(name)
    refused = []
    for kw in invalid:
        try:
            dcpgraph.compile(model, block_size=BLOCK_SIZE, **kw)
        except dcpgraph.ConfigError as err:
            refused.append(str(err))
        else:
            refused.append(None)
    dist.barrier()  # every rank got here: nobody is stuck in a collective of a refused config
    engine = dcpgraph.compile(model, tp=world, dcp=dcp, interleave=interleave, comm=comm,
                              block_size=BLOCK_SIZE, max_num_batched_tokens=MAX_BATCHED)
    tokens = engine.generate([list(p) for p in PROMPTS], MAX_NEW)
    return {"refused": refused, "tokens": tokens, "report": engine.report(),
            "memory": engine.memory_report()}


@pytest.mark.gloo
@pytest.mark.slow  # several gloo worlds compiling on 2 cores; the default tier keeps test_step_broadcast's
@pytest.mark.parametrize("world", sorted(CASES))
def test_gloo_ranks_generate_hf_tokens(world):
    name, dcp, interleave, comm, invalid = CASES[world]
    results = spawn(_rank, world, name, dcp, interleave, comm, invalid, timeout_s=120)
    model = build_model(name)
    reference = [hf_greedy(model, p, MAX_NEW) for p in PROMPTS]
    for rank, result in enumerate(results):
        assert all(message is not None for message in result["refused"]), (rank, result["refused"])
        assert result["report"]["executor"] == "distributed", rank
        assert result["report"]["comm"] == comm
        assert result["memory"]["tp"] == world and result["memory"]["dcp"] == dcp
        assert result["tokens"] == results[0]["tokens"], f"rank {rank} disagrees with rank 0"
    for prompt, got, want in zip(PROMPTS, results[0]["tokens"], reference):
        assert got == want, f"prompt of length {len(prompt)}"
    assert "world size" in results[0]["refused"][1] or "tp=" in results[0]["refused"][1]
