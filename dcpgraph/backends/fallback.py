"""``FallbackGraph``: a compiled graph that falls back to eager on any failure, once, for good.

The compile and the **first call** are both guarded: torchair's GE mode converts at compile time
but builds and loads the Ascend graph lazily on the first run, so a CANN error surfaces only
there. On failure the graph switches to the GraphModule itself (identical results: it is the
program the backend was given), records ``{"backend": "eager", "fallback": reason}`` in its
status, and warns once. Later failures of an already-working compiled graph are real errors and
propagate.
"""

from __future__ import annotations

import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch


class FallbackGraph:
    def __init__(self, name: str, gm: torch.fx.GraphModule, factory: Callable, *, program=None,
                 backend: str | None = None):
        self.name = name
        self.gm = gm
        self.factory = factory
        self.program = program
        label = backend or getattr(factory, "__name__", "custom").lstrip("_")
        self.status: dict[str, Any] = {"backend": label, "fallback": None, "calls": 0}
        self._compiled: Callable | None = None
        self._proven = False

    def _fall_back(self, stage: str, err: BaseException) -> None:
        reason = f"{stage} failed: {type(err).__name__}: {err}".strip()
        first_line = reason.splitlines()[0][:500]
        self.status.update(backend="eager", fallback=first_line,
                           traceback="".join(traceback.format_exception(err))[-4000:])
        self._compiled = self.gm
        self._proven = True
        warnings.warn(f"dcpgraph: graph {self.name!r} runs eagerly: {first_line}", RuntimeWarning, stacklevel=3)

    def __call__(self, *args):
        self.status["calls"] += 1
        if self._proven:
            return self._compiled(*args)
        if self._compiled is None:
            try:
                self._compiled = self.factory(self.gm, list(args))
            except Exception as err:  # noqa: BLE001 - any compile failure means eager
                self._fall_back("compile", err)
                return self.gm(*args)
        snapshot = _snapshot_mutable(self.program, args)
        try:
            result = self._compiled(*args)
        except Exception as err:  # noqa: BLE001 - the first call is part of compiling
            _restore_mutable(snapshot)
            self._fall_back("first call", err)
            return self.gm(*args)
        self._proven = True
        return result


def _snapshot_mutable(program, args) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Copies of the KV caches among ``args``: a first call that fails half-way must not leave a
    half-written cache behind before eager runs the step again (nothing half-written)."""
    if program is None:
        return []
    from ..program import CACHE

    return [(a, a.clone()) for spec, a in zip(program.inputs, args) if spec.kind == CACHE]


def _restore_mutable(snapshot) -> None:
    for tensor, copy in snapshot:
        tensor.copy_(copy)
