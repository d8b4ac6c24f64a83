"""The eager PCP path on real gloo processes: every rank runs only its own rank program, the K/V
exchange, the DCP query gather and all-to-all going through ``torch.distributed``.

One spawn per mesh, (tp, pcp, dcp) in {(1,2,2), (2,2,2)} (world 2 and 4, the second with the TP
all-reduce; ~15–60 s each on a loaded 2-core machine):
each rank builds the same seeded fp64 Qwen3 of :mod:`test_pcp`, generates greedily with a chunked
PCP prefill and a prefix reused from an earlier request, and every rank's tokens must equal HF
``generate`` on the same weights.
"""

from __future__ import annotations

import pytest
import torch
from pcp_models import matches_hf, pcp_model

from dcpgraph.runtime.distributed import spawn

PROMPT_SEED, SHARED, FIRST, SECOND, NEW = 11, 20, 7, 33, 6


def _prompts():
    g = torch.Generator().manual_seed(PROMPT_SEED)
    shared = torch.randint(0, 128, (SHARED,), generator=g).tolist()
    return (shared + torch.randint(0, 128, (FIRST,), generator=g).tolist(),
            shared + torch.randint(0, 128, (SECOND,), generator=g).tolist())


def _rank(rank: int, world: int, tp: int, pcp: int, dcp: int):
    from dcpgraph import Mesh
    from dcpgraph.pcp.distributed import new_rank_groups, run_distributed
    from dcpgraph.pcp.generate import generate_greedy

    mesh = Mesh(tp=tp, dcp=dcp, pcp=pcp)
    groups = new_rank_groups(mesh, rank)

    def run(programs):
        return {r: run_distributed(p, groups) for r, p in programs.items()}

    model = pcp_model("qwen3")
    first, second = _prompts()
    _, caches = generate_greedy(model, mesh, first, 2, prefill_chunk=9, ranks=[rank], run=run, interleave=2)
    reused = {rank: caches[rank].truncated(SHARED)}
    tokens, _ = generate_greedy(model, mesh, second, NEW, prefill_chunk=8, ranks=[rank], run=run,
                                reused=reused, reused_len=SHARED, interleave=2)
    return tokens


@pytest.mark.slow
@pytest.mark.parametrize("tp, pcp, dcp", [(1, 2, 2), (2, 2, 2)])
def test_pcp_on_gloomatches_hf(tp, pcp, dcp):
    results = spawn(_rank, tp * pcp, tp, pcp, dcp, timeout_s=300)
    _, second = _prompts()
    assert all(tokens == results[0] for tokens in results)
    assert matches_hf(pcp_model("qwen3"), second, results[0])
