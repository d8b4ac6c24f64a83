"""A PCP rank's prefill attention: its queries over every earlier key, merged by log-sum-exp.

Rank ``r`` holds the queries of its two chunks (:mod:`.split`); after the per-layer exchange it
also holds every new token's K/V in prompt order. For a chunk ``[s, e)`` its queries see:

- the cached context (positions before the prompt's new tokens) in full — one partial;
- new keys ``0..e-1`` bottom-right causally (query ``s + i`` sees keys ``≤ s + i``) — another;

and ``out = Σ exp(lse_i − lse)·out_i`` over those partials (:func:`dcpgraph.ops.merge.merge_attention_reference`),
which equals dense causal attention over ``cached ++ new`` exactly up to floating-point rounding.
"""

from __future__ import annotations

import torch

from ..ops.kernels import attend
from ..ops.merge import merge_attention_reference
from .split import rank_token_indices


def in_prompt_order(pieces: list[torch.Tensor], num_tokens: int, pcp: int) -> torch.Tensor:
    """Every rank's rows (rank ``r``'s in :func:`rank_token_indices` order) back in prompt order."""
    order = [i for r in range(pcp) for i in rank_token_indices(num_tokens, pcp, r)]
    stacked = torch.cat(pieces, dim=0)
    if stacked.shape[0] != num_tokens:
        raise ValueError(f"in_prompt_order: {stacked.shape[0]} rows from {pcp} ranks, expected {num_tokens}")
    inverse = torch.empty(num_tokens, dtype=torch.long)
    inverse[torch.tensor(order, dtype=torch.long)] = torch.arange(num_tokens)
    return stacked[inverse]


def new_token_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                        chunks: tuple[tuple[int, int], ...], scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of a rank's queries ``q`` (its chunks' rows, in order) over the new K/V
    ``[n, Hkv, D]`` in prompt order, causal by new-token index."""
    outs, lses, row = [], [], 0
    for start, end in chunks:
        rows = end - start
        if rows == 0:
            continue
        o, lse = attend(q[row:row + rows], k_new[:end], v_new[:end], scale, causal=True)
        outs.append(o)
        lses.append(lse)
        row += rows
    if row != q.shape[0]:
        raise ValueError(f"new_token_attention: q has {q.shape[0]} rows, the chunks {chunks} cover {row}")
    if not outs:
        return attend(q, k_new[:0], v_new[:0], scale)
    return torch.cat(outs), torch.cat(lses)


def merge_partials(partials: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The LSE merge of partials over disjoint key sets (one partial passes through)."""
    if len(partials) == 1:
        return partials[0]
    return merge_attention_reference(torch.stack([o for o, _ in partials]), torch.stack([lse for _, lse in partials]))
