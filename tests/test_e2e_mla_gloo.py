"""End-to-end MLA on real ``gloo`` processes: DeepSeek-V3 tiny, tp=2, dcp=2, one spawn.

Each rank builds the same seeded model (:func:`test_e2e_mla.build`: ``q_lora_rank``, MoE with
replicated routed experts), checks that an MLA-invalid mesh raises ``ConfigError`` locally (a rank
that did not would wait in a collective its peer never enters, and the spawn would time out), then
calls ``dcpgraph.compile(model, ...)``, which traces, absorbs the MLA into latent form and picks the
distributed executor because ``torch.distributed`` is initialised with world size == tp. Interleave
``block_size`` and ``ag_rs`` (the emulated tests run this pair with both comms). Every rank must
return the same tokens, equal to HF ``generate(do_sample=False)`` prompt by prompt, with the latent
caches sharded (per-token bytes halved) and each rank holding exactly its share of the tokens.
"""

from __future__ import annotations

import pytest
from mla_models import (
    BLOCK_SIZE,
    KV_LORA_RANK,
    LAYERS,
    MAX_BATCHED,
    MAX_NEW,
    PROMPTS,
    ROPE,
    build,
    hf_greedy,
)

from dcpgraph import layout
from dcpgraph.runtime.distributed import spawn

NAME = "deepseek_v3"
TP, DCP, INTERLEAVE, COMM = 2, 2, BLOCK_SIZE, "ag_rs"


def _rank(rank: int, world: int, name: str):
    import torch.distributed as dist

    import dcpgraph

    model = build(name)
    try:
        dcpgraph.compile(model, tp=world, dcp=4, block_size=BLOCK_SIZE)  # tp % dcp != 0
    except dcpgraph.ConfigError as err:
        refused = str(err)
    else:
        refused = None
    dist.barrier()  # both ranks got here: nobody is stuck in a collective of the refused config
    engine = dcpgraph.compile(model, tp=world, dcp=DCP, interleave=INTERLEAVE, comm=COMM,
                              block_size=BLOCK_SIZE, max_num_batched_tokens=MAX_BATCHED)
    tokens = engine.generate([list(p) for p in PROMPTS], MAX_NEW)
    written = sum(int((c.abs().sum(-1) > 0).sum()) for c in engine.executor.caches.values())
    return {
        "refused": refused, "tokens": tokens, "report": engine.report(), "memory": engine.memory_report(),
        "caches": sorted(engine.executor.caches), "written": written,
    }


@pytest.mark.gloo
def test_gloo_deepseek_v3_tp2_dcp2_matches_hf():
    results = spawn(_rank, TP, NAME, timeout_s=120)
    model = build(NAME)
    reference = [hf_greedy(model, p, MAX_NEW) for p in PROMPTS]
    per_token = LAYERS * (KV_LORA_RANK + ROPE) * 8 / DCP
    for rank, result in enumerate(results):
        assert result["refused"] is not None and "tp % dcp" in result["refused"], rank
        assert result["report"]["executor"] == "distributed", rank
        assert result["report"]["comm"] == COMM and result["report"]["mesh"].startswith("Mesh(tp=2, dcp=2")
        assert (result["memory"]["tp"], result["memory"]["dcp"]) == (TP, DCP)
        assert result["memory"]["kv_bytes_per_token"] == per_token
        assert result["caches"] == [f"latent_cache_{i}" for i in range(LAYERS)]
        for prompt, got, want in zip(PROMPTS, result["tokens"], reference):
            assert got == want, f"rank {rank}, prompt of length {len(prompt)}"
        # this rank holds exactly its share of every request's latent KV (the last sampled token
        # is never fed back); no block is reused at the default cache size
        share = sum(layout.local_len(len(p) + len(out) - 1, rank % DCP, DCP, INTERLEAVE)
                    for p, out in zip(PROMPTS, result["tokens"]))
        assert result["written"] == LAYERS * share, rank
