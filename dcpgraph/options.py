"""The options of :func:`dcpgraph.compile`, checked before any tracing, pass or collective.

:func:`compile_options` returns every option with its default filled in, or raises: ``TypeError``
for a name ``compile`` does not take, :class:`~dcpgraph.errors.ConfigError` for a value of the
wrong type or out of range, or two cache sizes at once. Every message names the valid settings.

One spelling per option, vLLM's where vLLM has one. The older spellings still work, with a
``DeprecationWarning`` naming the new one (:data:`DEPRECATED_OPTIONS`): ``max_batched_tokens``
is ``max_num_batched_tokens``; ``speculative_tokens=k`` is
``speculative_config={"method": "ngram", "num_speculative_tokens": k}``. Giving an option in both
spellings is a ``ConfigError``.
Rules that depend on the model (head counts, ``block_size % interleave``) are
:meth:`dcpgraph.mesh.Mesh.validate`'s.
"""

from __future__ import annotations

import numbers
import os
import sys
import warnings
from collections.abc import Mapping
from typing import Any

from .backends.registry import SPLIT_NEW_TOKENS, resolve_backend
from .capacity import KV_CACHE_DTYPE_ALIASES, KV_CACHE_DTYPES, canonical_kv_cache_dtype
from .errors import ConfigError
from .runtime.speculative_config import speculative_config

COMMS = ("auto", "a2a", "ag_rs", "ag")
EXECUTORS = ("auto", "emulated", "distributed")
CACHE_SIZE_OPTIONS = ("num_blocks", "kv_cache_tokens", "kv_cache_bytes_per_rank")
KV_ALLOCATIONS = ("on_demand", "whole_request")

# name -> (default, smallest allowed value) for integer options
_INTS = {
    "interleave": (1, 1),
    "block_size": (16, 1),
    "max_num_seqs": (8, 1),
    "max_num_batched_tokens": (256, 1),
    "capture_limit": (32, 0),
    "max_waiting": (1024, 1),
}
_OPTIONAL_INTS = ("max_model_len", *CACHE_SIZE_OPTIONS)  # None, or an int >= 1
_BOOLS = {"verify": True, "enable_prefix_caching": False, "enable_expert_parallel": False, "mlapo": True,
          "hybrid_kv_cache": False}
_OTHER = ("comm", "backend", "executor", "plan", "kv_allocation", "kv_cache_dtype", "speculative_config",
          "compile_cache_dir", "fuse_new_tokens")
VALID_OPTIONS = tuple(sorted((*_INTS, *_OPTIONAL_INTS, *_BOOLS, *_OTHER)))
# older spelling -> the option that replaces it (accepted with a DeprecationWarning)
DEPRECATED_OPTIONS = {"max_batched_tokens": "max_num_batched_tokens", "speculative_tokens": "speculative_config"}


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def compile_options(**given: Any) -> dict[str, Any]:
    """Every compile option, defaults filled in, after checking names, types and ranges."""
    given = _renamed(given)
    unknown = sorted(set(given) - set(VALID_OPTIONS))
    if unknown:
        raise TypeError(f"unknown options: {unknown}; compile takes {list(VALID_OPTIONS)}")
    out: dict[str, Any] = {}
    for name, (default, low) in _INTS.items():
        value = given.get(name, default)
        if not _is_int(value) or value < low:
            raise ConfigError(f"{name} must be an int >= {low}, got {value!r}")
        out[name] = int(value)
    for name in _OPTIONAL_INTS:
        value = given.get(name)
        if value is not None and (not _is_int(value) or value < 1):
            raise ConfigError(f"{name} must be None or an int >= 1, got {value!r}")
        out[name] = None if value is None else int(value)
    for name, default in _BOOLS.items():
        value = given.get(name, default)
        if not isinstance(value, bool):
            raise ConfigError(f"{name} must be True or False, got {value!r}")
        out[name] = value
    sizes = [name for name in CACHE_SIZE_OPTIONS if out[name] is not None]
    if len(sizes) > 1:
        raise ConfigError(f"give at most one of {list(CACHE_SIZE_OPTIONS)}, got {sizes}")
    comm = given.get("comm", "auto")
    if comm not in COMMS:
        raise ConfigError(f"comm must be 'auto', 'a2a', 'ag_rs' or 'ag', got {comm!r}")
    executor = given.get("executor", "auto")
    if executor not in EXECUTORS:
        raise ConfigError(f"executor must be 'auto', 'emulated' or 'distributed', got {executor!r}")
    kv_allocation = given.get("kv_allocation", "on_demand")
    if kv_allocation not in KV_ALLOCATIONS:
        raise ConfigError(f"kv_allocation must be one of {list(KV_ALLOCATIONS)}, got {kv_allocation!r}")
    kv_cache_dtype = canonical_kv_cache_dtype(given.get("kv_cache_dtype", "auto"))
    if not isinstance(kv_cache_dtype, str) or kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ConfigError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)} (or vLLM's "
                          f"{sorted(KV_CACHE_DTYPE_ALIASES)} for the same caches), got {kv_cache_dtype!r}")
    plan = given.get("plan")
    if plan is not None and not (
        isinstance(plan, Mapping) and all(isinstance(k, str) and isinstance(v, str) for k, v in plan.items())
    ):
        raise ConfigError(f"plan must be None or a dict of module-path pattern -> rule name, got {plan!r}")
    cache_dir = given.get("compile_cache_dir")
    if cache_dir is not None and not isinstance(cache_dir, (str, os.PathLike)):
        raise ConfigError(f"compile_cache_dir must be None or a directory path (str or os.PathLike), got {cache_dir!r}")
    backend = given.get("backend", "auto")
    name, _ = resolve_backend(backend)  # raises ConfigError naming the backends for an unknown name
    fuse_new = _fuse_new_tokens(given.get("fuse_new_tokens"), name)
    spec = speculative_config(given.get("speculative_config"))
    return {**out, "comm": comm, "executor": executor, "plan": plan, "backend": backend,
            "kv_allocation": kv_allocation, "kv_cache_dtype": kv_cache_dtype, "speculative_config": spec,
            "compile_cache_dir": None if cache_dir is None else os.fspath(cache_dir), "fuse_new_tokens": fuse_new}


def _renamed(given: dict[str, Any]) -> dict[str, Any]:
    """``given`` with the older spellings replaced by the options they stand for, each with a
    ``DeprecationWarning``; both spellings of one option at once are refused."""
    given = dict(given)
    if "max_batched_tokens" in given:
        _deprecated("max_batched_tokens is deprecated: use max_num_batched_tokens (vLLM's name), the same budget")
        if "max_num_batched_tokens" in given:
            raise ConfigError("give max_num_batched_tokens or its deprecated spelling max_batched_tokens, not both")
        given["max_num_batched_tokens"] = given.pop("max_batched_tokens")
    if "speculative_tokens" in given:
        k = given.pop("speculative_tokens")
        _deprecated(f"speculative_tokens={k!r} is deprecated: use "
                    f"speculative_config={{\"method\": \"ngram\", \"num_speculative_tokens\": {k!r}}}")
        if not _is_int(k) or k < 0:
            raise ConfigError(f"speculative_tokens must be an int >= 0, got {k!r}")
        if given.get("speculative_config") is not None:
            raise ConfigError("give speculative_config or the older speculative_tokens (which means "
                              "{'method': 'ngram', 'num_speculative_tokens': k}), not both")
        if k:
            given["speculative_config"] = {"method": "ngram", "num_speculative_tokens": int(k)}
    return given


def _deprecated(message: str) -> None:
    """A ``DeprecationWarning`` attributed to the first caller outside dcpgraph (the line that
    called ``dcpgraph.compile``, ``LLM``, ...), however deep inside the package it is raised."""
    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    frame, level = sys._getframe(0), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, DeprecationWarning, stacklevel=level)


def _fuse_new_tokens(value: Any, backend: str) -> bool:
    """``fuse_new_tokens``: None (default) fuses except for the backends that cannot lower a fused
    read (:data:`dcpgraph.backends.registry.SPLIT_NEW_TOKENS`); True/False force it."""
    if value is None:
        return backend not in SPLIT_NEW_TOKENS
    if not isinstance(value, bool):
        raise ConfigError(f"fuse_new_tokens must be None (by backend), True or False, got {value!r}")
    if value and backend in SPLIT_NEW_TOKENS:
        raise ConfigError(f"fuse_new_tokens=True cannot lower on backend {backend!r}: its paged attention "
                          "takes no causal bound inside the cache; leave it None or False")
    return value
