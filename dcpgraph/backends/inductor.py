"""Inductor: ``torch.compile`` of the per-rank GraphModule (dynamic token count)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def compile_inductor(gm: torch.fx.GraphModule, example_inputs: list, *, static: bool = False) -> Callable:
    """Static-shape graphs (decode buckets) compile with ``dynamic=False``; the mixed graph with
    a dynamic token count."""
    return torch.compile(gm, backend="inductor", dynamic=not static, fullgraph=True)
