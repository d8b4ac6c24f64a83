"""What every draft proposer gives the model runner, and how one is chosen.

A proposer has ``method`` (its ``speculative_config`` name) and ``propose(plan)``: for every
:class:`~dcpgraph.runtime.scheduler.ScheduledChunk` of a step, the :class:`Drafts` that follow the
chunk (at most ``item.draft_room`` tokens; none where the room is 0). The target model then runs
each chunk followed by its drafts as one multi-token query and
:func:`~dcpgraph.speculative.rejection.verify` decides which drafts stand.

Invariant: a proposer never changes a request; whatever state it keeps (a draft model's KV
cache) is keyed by request and checked against the request's ``computed`` on every call, so
rejected drafts, preemptions and prefix-cache hits need no callback.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class Drafts:
    """Draft ``tokens`` for one chunk and, for a sampled request, ``probs[j]`` the distribution
    (``[V]``) draft ``j`` was drawn from; ``None`` means one-hot (deterministic drafts)."""

    tokens: list[int]
    probs: torch.Tensor | None = None


class Proposer(Protocol):
    method: str

    def propose(self, plan) -> list[Drafts]: ...


NO_DRAFTS = Drafts([])
