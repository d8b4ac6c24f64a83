"""Dynamo backends: ``torch.compile`` of the per-rank GraphModule, every compile counted.

``"inductor"`` generates code; ``"aot_eager"`` runs dynamo and AOTAutograd (functionalisation,
decompositions) but executes the captured graph eagerly: the same guards and the same
recompilations as inductor at a fraction of the cost, which makes it the backend to check capture
and recompilation behaviour with.

Static-shape graphs (decode buckets) compile with ``dynamic=False``. The mixed graph compiles with
dynamic shapes, and its calls run with ``backed_size_oblivious``: a size that is 1 in one step and
5 in the next (one request or many, one block-table column or many) stays one symbol instead of
being specialised to 1 and recompiled the first time it is not.

Every compile dynamo asks this backend for, the first one and every recompilation after a guard
failed, calls ``on_compile(seconds)`` with the time the inner compiler took.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

INNER_COMPILERS = ("inductor", "aot_eager")


def compile_dynamo(
    gm: torch.fx.GraphModule,
    example_inputs: list,
    *,
    inner: str = "inductor",
    static: bool = False,
    on_compile: Callable[[float], None] | None = None,
) -> Callable:
    if inner not in INNER_COMPILERS:
        raise ValueError(f"inner compiler must be one of {INNER_COMPILERS}, got {inner!r}")
    from torch._dynamo.backends.registry import lookup_backend

    compiler = lookup_backend(inner)

    def counted(graph: torch.fx.GraphModule, inputs: list) -> Callable:
        start = time.perf_counter()
        out = compiler(graph, inputs)
        if on_compile is not None:
            on_compile(time.perf_counter() - start)
        return out

    compiled = torch.compile(gm, backend=counted, dynamic=not static, fullgraph=True)
    if static:
        return compiled

    def run_size_oblivious(*args):
        with torch.fx.experimental._config.patch(backed_size_oblivious=True):
            return compiled(*args)

    return run_size_oblivious
