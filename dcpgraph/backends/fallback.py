"""``FallbackGraph``: a compiled graph that falls back to eager on any failure, once, for good.

The compile and the **first call** are both guarded: torchair's GE mode converts at compile time
but builds and loads the Ascend graph lazily on the first run, so a CANN error surfaces only
there. On failure the graph switches to the GraphModule itself (identical results: it is the
program the backend was given), records ``{"backend": "eager", "fallback": reason}`` in its
status, and warns once. Later failures of an already-working compiled graph are real errors and
propagate.

Nothing is left half-written by a first call that dies: the only cache rows a step may write are
its own ``slot_mapping`` rows (a functionalised copy-back of the whole cache writes old values
everywhere else), and the eager re-run of the same step rewrites exactly those rows. So no
snapshot is taken — an earlier version cloned every cache, an O(capacity) copy that protected
nothing (``tests/test_backends.py`` poisons those rows and checks eager's tokens).
"""

from __future__ import annotations

import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch


class FallbackGraph:
    def __init__(self, name: str, gm: torch.fx.GraphModule, factory: Callable, *, backend: str | None = None,
                 on_compile: Callable[[float], None] | None = None):
        self.name = name
        self.on_compile = on_compile  # seconds of the factory call + first call, if given
        self.gm = gm
        self.factory = factory
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
        start = time.perf_counter()
        try:
            if self._compiled is None:
                try:
                    self._compiled = self.factory(self.gm, list(args))
                except Exception as err:  # noqa: BLE001 - any compile failure means eager
                    self._fall_back("compile", err)
                    return self.gm(*args)
            try:
                result = self._compiled(*args)
            except Exception as err:  # noqa: BLE001 - the first call is part of compiling
                self._fall_back("first call", err)
                return self.gm(*args)
        finally:
            if self.on_compile is not None:
                self.on_compile(time.perf_counter() - start)
        self._proven = True
        return result
