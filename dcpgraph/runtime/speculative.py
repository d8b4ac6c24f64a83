"""Speculative decoding with prompt-lookup drafts, verified exactly by the target model.

A decode row whose request is greedy gets up to ``k`` draft tokens: the tokens that followed the
most recent earlier occurrence of its last ``n``-gram (``n`` from ``max_ngram`` down to 1) in its
own history. The target model runs ``[last token, d1 … dk]`` as one multi-token query; row ``j``'s
greedy token is emitted, and draft ``j+1`` is accepted only if it equals that token, so the output
is exactly what one-token greedy decoding gives. Under DCP this is exact for free: the step's
tokens are the *new* part of the context/new split (causal among themselves, no communication),
so no CP-aware causal mask is needed (vLLM #45425 is the bug this design cannot have). KV written
for rejected drafts lies beyond ``computed`` and is never read; it is overwritten later.
"""

from __future__ import annotations


def propose(tokens: list[int], k: int, max_ngram: int = 3) -> list[int]:
    """Up to ``k`` tokens continuing the latest earlier match of the history's last n-gram."""
    if k <= 0:
        return []
    for n in range(min(max_ngram, len(tokens) - 1), 0, -1):
        tail = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == tail:
                follow = tokens[start + n : start + n + k]
                if follow:
                    return follow
    return []


def accept(drafts: list[int], greedy: list[int]) -> int:
    """How many drafts the target's greedy tokens confirm (``greedy[j]`` follows draft ``j``)."""
    accepted = 0
    while accepted < len(drafts) and greedy[accepted] == drafts[accepted]:
        accepted += 1
    return accepted
