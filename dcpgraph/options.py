"""The options of :func:`dcpgraph.compile`, checked before any tracing, pass or collective.

The checks live in :mod:`dcpgraph.config` (the configuration tree ``compile``, ``LLM`` and
``dcpgraph serve`` all build); :func:`compile_options` is the dict view of it that
:func:`dcpgraph.compile` reads: every option with its default filled in, or raises: ``TypeError``
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

from typing import Any

from .config import (
    CACHE_SIZE_OPTIONS,
    COMMS,
    DEPRECATED_OPTIONS,
    EXECUTORS,
    KV_ALLOCATIONS,
    VALID_OPTIONS,
    DcpgraphConfig,
)

__all__ = ["CACHE_SIZE_OPTIONS", "COMMS", "DEPRECATED_OPTIONS", "EXECUTORS", "KV_ALLOCATIONS", "VALID_OPTIONS",
           "compile_options"]


def compile_options(**given: Any) -> dict[str, Any]:
    """Every compile option, defaults filled in, after checking names, types and ranges."""
    mesh = sorted({"tp", "dcp"} & set(given))
    if mesh:
        raise TypeError(f"unknown options: {mesh}; compile takes {list(VALID_OPTIONS)}")
    return DcpgraphConfig.from_compile_options(**given).compile_options()
