"""Names of the backends and how each turns a GraphModule into a callable.

A factory is ``(gm, example_inputs) -> callable``, torch.compile's backend signature; imports of
optional stacks (inductor's toolchain, torch_npu/torchair) happen inside the factory, so merely
naming a backend never imports them.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

import torch

from ..errors import ConfigError

Factory = Callable[[torch.fx.GraphModule, list], Callable]


def _eager(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
    return gm


def _inductor(gm: torch.fx.GraphModule, example_inputs: list, **options: Any) -> Callable:
    from .inductor import compile_dynamo

    return compile_dynamo(gm, example_inputs, inner="inductor", **options)


def _aot_eager(gm: torch.fx.GraphModule, example_inputs: list, **options: Any) -> Callable:
    from .inductor import compile_dynamo

    return compile_dynamo(gm, example_inputs, inner="aot_eager", **options)


# Dynamo-based factories take ``static=`` (decode buckets) and ``on_compile=`` (called once per
# compile, recompilations included); other factories are counted by the call that builds them.
for _factory in (_inductor, _aot_eager):
    _factory.wants_static = True
    _factory.counts_compiles = True


def _torchair(gm: torch.fx.GraphModule, example_inputs: list, **options: Any) -> Callable:
    from .torchair import compile_torchair

    return compile_torchair(gm, example_inputs, mode="max-autotune", **options)


def _npugraph_ex(gm: torch.fx.GraphModule, example_inputs: list, **options: Any) -> Callable:
    from .torchair import compile_torchair

    return compile_torchair(gm, example_inputs, mode="npugraph_ex", **options)


GE_FACTORY = _torchair  # the backend that needs every dcpgraph op lowered (lower_npu)

_BACKENDS: dict[str, Factory | None] = {
    "eager": None,
    "inductor": _inductor,
    "aot_eager": _aot_eager,
    "torchair": _torchair,
    "npugraph_ex": _npugraph_ex,
}


# Backends whose paged attention takes no per-query causal bound inside the cache: Ascend's
# FusedInferAttentionScore reads a request's keys up to its length, so a program for them keeps the
# context/new split of ``insert_kv_cache`` (``fuse_new_tokens`` off) and every read lowers to it.
SPLIT_NEW_TOKENS = frozenset({"torchair", "npugraph_ex"})


def ascend_available() -> bool:
    return importlib.util.find_spec("torch_npu") is not None


def available_backends() -> list[str]:
    return ["auto", *_BACKENDS]


def resolve_backend(backend: Any) -> tuple[str, Factory | None]:
    """``(name, factory)``; a callable is a user backend named after itself."""
    if callable(backend):
        return getattr(backend, "__name__", "custom"), backend
    if backend == "auto":
        if ascend_available():
            return "torchair", _BACKENDS["torchair"]
        if torch.cuda.is_available():
            return "inductor", _BACKENDS["inductor"]
        return "eager", None
    if backend not in _BACKENDS:
        raise ConfigError(f"unknown backend {backend!r}; choose from {available_backends()} or pass a callable")
    return backend, _BACKENDS[backend]
