"""What every draft proposer gives the model runner, and how one is chosen.

A proposer has ``method`` (its ``speculative_config`` name) and ``propose(plan)``: for every
:class:`~dcpgraph.runtime.scheduler.ScheduledChunk` of a step, the :class:`Drafts` that follow the
chunk (at most ``item.draft_room`` tokens; none where the room is 0). The target model then runs
each chunk followed by its drafts as one multi-token query and
:func:`~dcpgraph.runtime.rejection.verify` decides which drafts stand.

The runtime holds only this interface; the proposers themselves live in
:mod:`dcpgraph.speculative`, which registers a factory per method with :func:`register_proposer`
when it is imported (``import dcpgraph`` does). :func:`make_proposer` builds an engine's proposer
through that table, so the runtime never imports its implementations.

Invariant: a proposer never changes a request; whatever state it keeps (a draft model's KV
cache) is keyed by request and checked against the request's ``computed`` on every call, so
rejected drafts, preemptions and prefix-cache hits need no callback.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from ..errors import ConfigError


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


ProposerFactory = Callable[..., Proposer]
"""``factory(config, draft, *, executor_cls, num_blocks, buckets, max_batched_tokens)`` -> the
proposer of one engine (arguments as :func:`make_proposer`'s)."""

_FACTORIES: dict[str, ProposerFactory] = {}


def register_proposer(method: str, factory: ProposerFactory) -> None:
    """Make ``speculative_config`` method ``method`` build its proposer with ``factory``."""
    _FACTORIES[method] = factory


def make_proposer(config, draft, *, executor_cls, num_blocks: int, buckets,
                  max_batched_tokens: int | None = None) -> Proposer:
    """The proposer an engine uses for its ``speculative_config`` (a
    :class:`~dcpgraph.runtime.speculative_config.SpeculativeConfig`). ``draft``: ``(compiled draft
    Program, its CompiledGraphs)`` for the methods that run a model (``draft_model``, ``mtp``), else
    None. The draft runs on its own executor (its own KV cache of ``num_blocks`` blocks, the
    target's block ids) with the target's decode bucket sizes; its catch-up forwards respect the
    target's ``max_batched_tokens``."""
    factory = _FACTORIES.get(config.method)
    if factory is None:
        raise ConfigError(f"method {config.method!r} is not available: see dcpgraph.speculative "
                          f"(registered: {sorted(_FACTORIES)})")
    return factory(config, draft, executor_cls=executor_cls, num_blocks=num_blocks, buckets=buckets,
                   max_batched_tokens=max_batched_tokens)
