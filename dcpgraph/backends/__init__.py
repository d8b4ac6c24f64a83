"""Backends that compile a per-rank program (issue 6 grows this into eager/inductor/torchair)."""

from __future__ import annotations


def compile_backend(program, backend, *, distributed: bool):
    """Returns ``(callable or None, report)``; None means run the GraphModule as is (eager)."""
    if backend not in ("auto", "eager"):
        raise NotImplementedError(f"backend {backend!r} is not available yet")
    return None, {"backend": "eager"}
