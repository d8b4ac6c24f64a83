"""Prompt lookup (``method="ngram"``): drafts copied from the request's own history.

A decode row gets up to ``k`` draft tokens: the tokens that followed the most recent earlier
occurrence of its last ``n``-gram, ``n`` from ``prompt_lookup_max`` down to ``prompt_lookup_min``.
The drafts are deterministic, so their proposal distribution is one-hot
(``Drafts.probs is None``): rejection sampling then accepts draft ``d`` with probability ``p(d)``
and otherwise samples from ``p`` with ``d`` removed, which is exactly ``p``.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..runtime.proposer import Drafts


def propose(tokens: list[int], k: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Up to ``k`` tokens continuing the latest earlier match of the history's last n-gram."""
    if k <= 0:
        return []
    for n in range(min(max_ngram, len(tokens) - 1), min_ngram - 1, -1):
        tail = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == tail:
                follow = tokens[start + n : start + n + k]
                if follow:
                    return follow
    return []


class NgramProposer:
    method = "ngram"

    def __init__(self, min_ngram: int = 1, max_ngram: int = 3):
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram

    def propose(self, plan: Sequence) -> list[Drafts]:
        return [Drafts(propose(item.request.tokens, item.draft_room, self.max_ngram, self.min_ngram))
                for item in plan]
