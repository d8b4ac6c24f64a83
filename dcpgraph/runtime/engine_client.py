"""``EngineClient``: what the serving layer calls on an engine, wherever its ranks run.

Two implementations: :class:`~dcpgraph.runtime.engine.Engine`, whose ranks run in this process
(one rank under ``torchrun``, or every rank on the SPMD emulator), and
:class:`~dcpgraph.serving.workers.RemoteEngine`, whose ranks are worker processes. Callers hold an
``EngineClient`` and never ask which one it is.

Events, request ids and reports are the same on every rank (ranks run one deterministic schedule),
so a client returns one value for them; what differs by rank (KV transfer steps, cache use) comes
back as one value per rank, in rank order.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import Any

from .scheduler import StepEvent

RankOp = Callable[..., Any]
RANK_OPS: dict[str, RankOp] = {}
"""Named steps a rank runs beside its engine (``fn(engine, **args)``, JSON-able arguments and
result): the prefill/decode KV transfer registers its own (:mod:`dcpgraph.serving.kv_connector.rank_ops`)."""


def register_rank_op(name: str, fn: RankOp) -> None:
    RANK_OPS[name] = fn


def run_rank_op(engine, name: str, args: dict) -> Any:
    """``RANK_OPS[name](engine, **args)``; an unknown name is refused naming the known ones."""
    if name not in RANK_OPS:
        raise ValueError(f"unknown rank op {name!r}; known: {sorted(RANK_OPS)}")
    return RANK_OPS[name](engine, **args)


WAITING_IDS = "waiting_request_ids"


def _waiting_request_ids(engine) -> list[int]:
    """Ids of the requests the engine's scheduler has queued but not (re-)admitted, in queue order
    (the serving layer's queue-time metric: a request leaves this list when first scheduled)."""
    return [r.id for r in engine.scheduler.waiting]


register_rank_op(WAITING_IDS, _waiting_request_ids)


class EngineClient(abc.ABC):
    """Requests in, token events out; see the module docstring for what is per rank."""

    @abc.abstractmethod
    def add_request(self, prompt: Sequence[int], max_new_tokens: int, **sampling: Any) -> int:
        """Queue one request; its id. Raises ``RequestError`` before anything is queued."""

    @abc.abstractmethod
    def step(self) -> list[StepEvent]:
        """One scheduled step on every rank: one event per emitted token."""

    @abc.abstractmethod
    def abort(self, request_id: int) -> bool:
        """Stop a live request (its blocks are free on return); ``False`` if it was not live."""

    @abc.abstractmethod
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, **sampling: Any) -> list[list[int]]:
        """Every prompt to completion on an idle engine: each prompt's new tokens, in order."""

    @abc.abstractmethod
    def memory_report(self) -> dict:
        """KV and weight bytes per rank, capacity."""

    @abc.abstractmethod
    def report(self) -> dict:
        """Executor, graphs, scheduler, prefix cache and speculative counters."""

    @abc.abstractmethod
    def rank_call(self, name: str, args: dict) -> list:
        """:func:`run_rank_op` on every rank at once; one value per rank."""

    @abc.abstractmethod
    def kv_usage_per_rank(self) -> list[tuple[int, int]]:
        """``(blocks in use, blocks allocated)`` per rank (cached-free prefix blocks count as free)."""

    def healthy(self) -> bool:
        """Whether every rank can still serve (a worker group whose process died cannot)."""
        return True

    def worker_pids(self) -> list[int]:
        """The process id of each rank's worker, in rank order; empty when the ranks run in this process."""
        return []

    def close(self) -> None:
        """Release the ranks' processes, if the client started any; nothing to do in process."""
        return
