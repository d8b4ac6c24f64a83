"""Which data-parallel replica a request goes to: least outstanding, unless a replica already holds its prefix.

:class:`PrefixAwareRouter` keeps, per replica, the chained hashes of the full ``block_tokens``-token
blocks of the prompts it sent there (bounded, least recently used dropped first). For a new prompt
with block hashes ``h_1..h_n`` (``h_i`` hashes tokens ``[0, i·block_tokens)``), replica ``r``'s match
is the largest ``j`` with ``h_1..h_j`` all recorded for ``r``. The choice:

- ``best`` = the replica with the longest match (ties: fewer live requests, then the lower index);
- it is taken when its match is at least one block and its live requests are at most
  ``min_live + balance_slack`` (``min_live`` the least any replica has), so a popular prefix cannot
  pile every request onto one replica;
- otherwise the replica with the fewest live requests (ties: the lower index), vLLM's
  least-outstanding rule.

The record is a hint about what each replica's prefix cache may hold (a replica may have evicted
those blocks since): routing changes only where a request runs, never its tokens.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


def block_hashes(prompt: Sequence[int], block_tokens: int) -> list[int]:
    """Chained hashes of the prompt's full blocks: ``h_i = hash((h_{i-1}, block_i))``, ``h_0 = 0``."""
    hashes, previous = [], 0
    for start in range(0, len(prompt) - block_tokens + 1, block_tokens):
        previous = hash((previous, tuple(prompt[start:start + block_tokens])))
        hashes.append(previous)
    return hashes


class PrefixAwareRouter:
    def __init__(self, replicas: int, *, block_tokens: int = 16, balance_slack: int = 2,
                 capacity: int = 1 << 16):
        if replicas < 1 or block_tokens < 1 or balance_slack < 0 or capacity < 1:
            raise ValueError(f"PrefixAwareRouter needs replicas >= 1, block_tokens >= 1, balance_slack >= 0 and "
                             f"capacity >= 1; got {replicas}, {block_tokens}, {balance_slack}, {capacity}")
        self.block_tokens = block_tokens
        self.balance_slack = balance_slack
        self.capacity = capacity
        self._held: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(replicas)]
        self.prefix_routed = 0  # requests sent to a replica for its recorded prefix rather than its load

    def matched_blocks(self, replica: int, hashes: Sequence[int]) -> int:
        held = self._held[replica]
        count = 0
        for h in hashes:
            if h not in held:
                break
            count += 1
        return count

    def choose(self, prompt: Sequence[int], live: Sequence[int]) -> int:
        """The replica for ``prompt`` given each replica's live requests; records the prompt there."""
        hashes = block_hashes(prompt, self.block_tokens)
        least = min(range(len(live)), key=lambda i: (live[i], i))
        matches = [self.matched_blocks(i, hashes) for i in range(len(live))]
        best = min(range(len(live)), key=lambda i: (-matches[i], live[i], i))
        chosen = least
        if matches[best] > 0 and live[best] <= live[least] + self.balance_slack:
            chosen = best
            self.prefix_routed += best != least
        self._record(chosen, hashes)
        return chosen

    def _record(self, replica: int, hashes: Sequence[int]) -> None:
        held = self._held[replica]
        for h in hashes:
            held[h] = None
            held.move_to_end(h)
        while len(held) > self.capacity:
            held.popitem(last=False)
