"""The head-tail (zigzag) split of a prefill's new tokens over ``pcp`` ranks.

The ``n`` new tokens (indices ``0..n-1`` in prompt order) are cut into ``2·pcp`` contiguous chunks,
the first ``n mod 2pcp`` one token longer; rank ``r`` takes chunk ``r`` and chunk ``2pcp − 1 − r``.
Under causal attention a token at new index ``i`` after ``c`` cached tokens attends over
``c + i + 1`` keys, so pairing an early chunk with a late one gives every rank nearly the same
work: with ``n`` divisible by ``2pcp`` and ``c = 0`` every rank's key count is exactly
``n·(n + 1) / (2·pcp)``, a ``1/pcp`` share of the total — see :func:`causal_work`.
"""

from __future__ import annotations

from ..errors import ConfigError


def chunk_bounds(num_tokens: int, pcp: int) -> list[tuple[int, int]]:
    """The ``2·pcp`` chunks ``[start, end)`` of ``num_tokens`` new tokens (some empty when short)."""
    if pcp < 1 or num_tokens < 0:
        raise ConfigError(f"chunk_bounds needs pcp >= 1 and num_tokens >= 0, got pcp={pcp}, num_tokens={num_tokens}")
    pieces = 2 * pcp
    base, extra = divmod(num_tokens, pieces)
    bounds, start = [], 0
    for c in range(pieces):
        end = start + base + (1 if c < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def rank_chunks(num_tokens: int, pcp: int, rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Rank ``rank``'s two chunks: ``(head, tail) = (chunk rank, chunk 2pcp − 1 − rank)``."""
    if not 0 <= rank < pcp:
        raise ConfigError(f"pcp rank must be in [0, {pcp}), got {rank}")
    bounds = chunk_bounds(num_tokens, pcp)
    return bounds[rank], bounds[2 * pcp - 1 - rank]


def rank_token_indices(num_tokens: int, pcp: int, rank: int) -> list[int]:
    """The new-token indices rank ``rank`` computes, ascending (its head chunk, then its tail)."""
    (h0, h1), (t0, t1) = rank_chunks(num_tokens, pcp, rank)
    return [*range(h0, h1), *range(t0, t1)]


def causal_work(num_tokens: int, pcp: int, rank: int, num_cached: int = 0) -> int:
    """Keys rank ``rank``'s queries attend over in total: ``Σ_i (num_cached + i + 1)`` over its tokens."""
    return sum(num_cached + i + 1 for i in rank_token_indices(num_tokens, pcp, rank))
