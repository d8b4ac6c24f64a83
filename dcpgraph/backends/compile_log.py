"""``CompileLog``: every compile of one engine's graphs, split at the end of start-up.

A compile is one call of a backend's compiler: for the dynamo backends (``"inductor"``,
``"aot_eager"``) each compile dynamo requests, recompilations after a failed guard included; for
any other backend (a user callable, torchair) the factory call that builds the graph together
with its first call (torchair's GE graph is built there). Start-up capture runs every graph once
and then calls :meth:`mark_started`; any compile recorded after that is one a request waited for,
and serving should count none.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CompileEvent:
    graph: str
    seconds: float
    after_startup: bool


class CompileLog:
    def __init__(self) -> None:
        self.events: list[CompileEvent] = []
        self.started = False
        self.startup_seconds: dict[str, float] = {}

    def record(self, graph: str, seconds: float) -> None:
        self.events.append(CompileEvent(graph, float(seconds), self.started))

    def mark_started(self, startup_seconds: dict[str, float]) -> None:
        """Start-up is over: ``startup_seconds`` is the wall time of each graph's capture run
        (compile plus one execution)."""
        self.startup_seconds = dict(startup_seconds)
        self.started = True

    @property
    def compiles_after_startup(self) -> int:
        return sum(e.after_startup for e in self.events)

    def report(self) -> dict:
        """``startup_seconds`` per graph and in total, ``compiles_at_startup``,
        ``compiles_after_startup`` and the graphs those were for."""
        return {
            "captured": self.started,
            "startup_seconds": dict(self.startup_seconds),
            "startup_total_seconds": sum(self.startup_seconds.values()),
            "compiles_at_startup": sum(not e.after_startup for e in self.events),
            "compiles_after_startup": self.compiles_after_startup,
            "compiled_after_startup": sorted({e.graph for e in self.events if e.after_startup}),
        }
