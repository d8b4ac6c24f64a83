"""Greedy generation with a PCP prefill (in chunks, after an optional reused prefix) and DCP
decode: every rank emulated (:func:`.emulated.run_emulated`, the default) or this process's rank on
real process groups (``ranks=[rank]``, ``run`` from :func:`.distributed.run_distributed`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..errors import ConfigError
from ..mesh import Mesh
from .eager import RankCache, RankProgram, check_eager_pcp, decode_rank, prefill_rank
from .emulated import run_emulated

Runner = Callable[[dict[int, RankProgram]], dict[int, Any]]


@torch.no_grad()
def generate_greedy(model, mesh: Mesh, prompt: list[int], max_new_tokens: int, *, prefill_chunk: int | None = None,
                    interleave: int = 1, reused: dict[int, RankCache] | None = None,
                    reused_len: int = 0, ranks: list[int] | None = None,
                    run: Runner | None = None) -> tuple[list[int], dict[int, RankCache]]:
    """``max_new_tokens`` greedy tokens after ``prompt`` and every rank's cache after them.

    ``reused``/``reused_len``: rank caches holding the prompt's first ``reused_len`` positions
    (a prefix-cache hit); the prefill then covers ``prompt[reused_len:]`` in pieces of at most
    ``prefill_chunk`` tokens (chunked prefill), each one PCP prefill. ``ranks``/``run``: the ranks
    this process runs and how their programs are driven (default: all, emulated).
    """
    check_eager_pcp(model, mesh)
    if not prompt or max_new_tokens < 1 or (prefill_chunk is not None and prefill_chunk < 1):
        raise ConfigError(f"generate_greedy needs a non-empty prompt, max_new_tokens >= 1 and prefill_chunk None or "
                          f">= 1; got {len(prompt)} prompt tokens, max_new_tokens={max_new_tokens}, "
                          f"prefill_chunk={prefill_chunk}")
    if not 0 <= reused_len < len(prompt):
        raise ConfigError(f"reused_len must be in [0, {len(prompt)}) for a {len(prompt)}-token prompt, got {reused_len}")
    chunk = prefill_chunk or len(prompt)
    ranks = list(mesh.ranks) if ranks is None else ranks
    run = run or (lambda programs: run_emulated(mesh, programs))
    caches = reused if reused is not None else {r: RankCache() for r in ranks}
    logits = None
    for start in range(reused_len, len(prompt), chunk):
        ids = torch.tensor(prompt[start:start + chunk])
        out = run({r: prefill_rank(model, mesh, r, ids, start, caches[r], interleave) for r in ranks})
        logits = out[ranks[0]]
    tokens = []
    for step in range(max_new_tokens):
        token = int(logits.argmax())
        tokens.append(token)
        if step + 1 == max_new_tokens:
            break
        out = run({r: decode_rank(model, mesh, r, token, len(prompt) + step, caches[r], interleave)
                   for r in ranks})
        logits = out[ranks[0]]
    return tokens, caches
