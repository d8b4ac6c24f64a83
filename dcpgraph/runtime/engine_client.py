"""``EngineClient``: what the serving layer calls on an engine, wherever its ranks run.

Two implementations: :class:`~dcpgraph.runtime.engine.Engine`, whose ranks run in this process
(one rank under ``torchrun``, or every rank on the SPMD emulator), and
:class:`~dcpgraph.serving.workers.RemoteEngine`, whose ranks are worker processes. Callers hold an
``EngineClient`` and never ask which one it is.

One process schedules (the in-process engine, or rank 0 of the worker group), so events, request
ids and reports have one value; what differs by rank (a KV transfer's rank half) comes back as one
value per rank, in rank order.
"""

from __future__ import annotations

import abc
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .scheduler import Scheduler, StepEvent


@dataclass(frozen=True)
class RankOp:
    """A step run beside the engine, in two halves.

    ``driver(engine, **args)`` runs once, in the process that schedules (it reads or changes the
    schedule: a request's block table, holding or adopting a request). Without ``on_rank`` its
    result is the op's one value. With ``on_rank`` its result is the keyword arguments of
    ``on_rank(rank_state, **result)``, which then runs on every rank at once (it moves that rank's
    own KV) and gives one value per rank, in rank order. Arguments and results are plain data
    (they cross processes)."""

    driver: Callable[..., Any]
    on_rank: Callable[..., Any] | None = None


@dataclass(frozen=True)
class RankState:
    """What an op's rank half can use: its rank, the compiled program, the rank's caches by name."""

    rank: int
    program: Any
    caches: dict[str, Any]


RANK_OPS: dict[str, RankOp] = {}
"""Named rank ops; the prefill/decode KV transfer registers its own
(:mod:`dcpgraph.serving.kv_connector.rank_ops`)."""


def register_rank_op(name: str, driver: Callable[..., Any], on_rank: Callable[..., Any] | None = None) -> None:
    RANK_OPS[name] = RankOp(driver, on_rank)


def rank_op(name: str) -> RankOp:
    """The op registered as ``name``; an unknown name is refused naming the known ones."""
    if name not in RANK_OPS:
        raise ValueError(f"unknown rank op {name!r}; known: {sorted(RANK_OPS)}")
    return RANK_OPS[name]


def run_rank_op(engine, name: str, args: dict) -> list:
    """The op's driver half on ``engine`` (the scheduling one), then, if it has one, its rank half on
    every rank through ``engine.executor.each_rank``: one value, or one per rank."""
    op = rank_op(name)
    prepared = op.driver(engine, **args)
    if op.on_rank is None:
        return [prepared]
    return engine.executor.each_rank(name, prepared)


def run_on_rank(name: str, state: RankState, args: dict) -> Any:
    """The rank half of op ``name`` on one rank."""
    return rank_op(name).on_rank(state, **args)


def _process_report(state: RankState) -> dict:
    return {"rank": state.rank, "pid": os.getpid(), "schedulers": Scheduler.created}


register_rank_op("process.report", lambda engine: {}, _process_report)
"""Each rank's process id and how many schedulers its process has made (a worker group makes one,
on rank 0)."""


# the engine's own rank ops: driver halves only (they act on the one scheduler and block manager)
register_rank_op("reset_prefix_cache", lambda engine: engine.reset_prefix_cache())


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
        """:func:`run_rank_op`: the op's one value (``[value]``), or one value per rank."""

    @abc.abstractmethod
    def kv_usage_per_rank(self) -> list[tuple[int, int]]:
        """``(blocks in use, blocks allocated)`` per rank (cached-free prefix blocks count as free)."""

    # -- engines behind this client (data-parallel replicas; one otherwise) ----------------------
    @property
    def engine_count(self) -> int:
        """How many engines (schedulers with their own KV cache) answer through this client."""
        return 1

    def engine_of(self, request_id: int) -> int:
        """The index of the engine that runs live request ``request_id``."""
        return 0

    def engine_states(self) -> list[tuple[list[tuple[int, int]], dict]]:
        """Per engine, in index order: its :meth:`kv_usage_per_rank` and its :meth:`report`."""
        return [(self.kv_usage_per_rank(), self.report())]

    @abc.abstractmethod
    def enable_structured_outputs(self, backend) -> None:
        """Let requests carry ``structured_outputs`` (:meth:`Engine.enable_structured_outputs
        <dcpgraph.runtime.engine.Engine.enable_structured_outputs>`); a client whose engine runs
        in another process sends the backend's serialized text."""

    def begin_step(self) -> None:
        """Start :meth:`step` (a client whose ranks run elsewhere returns at once; the rest run it
        here); :meth:`end_step` gives its events. Lets several clients step at the same time."""
        self._begun = self.step()

    def end_step(self) -> list[StepEvent]:
        events, self._begun = self._begun, []
        return events

    def healthy(self) -> bool:
        """Whether every rank can still serve (a worker group whose process died cannot)."""
        return True

    def worker_pids(self) -> list[int]:
        """The process id of each rank's worker, in rank order; empty when the ranks run in this process."""
        return []

    def close(self) -> None:
        """Release the ranks' processes, if the client started any; nothing to do in process."""
        return
