"""Optional native (C++) kernel for paged decode attention, built lazily on first use.

:func:`native_paged_decode` computes what :func:`dcpgraph.ops.paged.paged_partial_attention`
does without ``kv_bound`` (row ``r``'s queries attend to its first ``kv_lens[r]`` cached tokens),
reading K and V **in place through the block table** (no gather copy, so a scattered table costs
what a contiguous one does). KV caches of fp32, bf16 or float8_e4m3fn with its per-128-element
scales (:mod:`dcpgraph.ops.quant`) are read as stored and converted to fp32 in registers (bf16/fp8
need an AVX-512 build: :func:`kv_dtypes`); queries of any float dtype are computed in fp32 and the
output is returned in the query's dtype, the LSE in fp32. For each (request, KV head, key chunk) the ``G``
query heads of the KV head are processed together, so every K/V row is read once per KV head,
with an online softmax over key blocks; chunks of one request are merged by LSE (split-K, so one
long request still uses every thread). Source: ``csrc/paged_decode.cpp``.

The extension is built lazily by :class:`~dcpgraph.ops.native_build.NativeExtension` (persistent
build directory keyed by the source and flags, never raises, ``reason`` when unavailable);
:data:`reason`, :data:`build_seconds` and :func:`build_dir` are this kernel's.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .native_build import STALE_LOCK_SECONDS, NativeExtension, clear_stale_lock

_SRC = Path(__file__).resolve().parent / "csrc" / "paged_decode.cpp"
EXTENSION = NativeExtension("dcpgraph_paged_decode", _SRC, "native paged-decode kernel", "decode runs on the torch path")
_clear_stale_lock = clear_stale_lock
__all__ = ["STALE_LOCK_SECONDS", "available", "build_dir", "kv_dtypes", "native_paged_decode", "supports"]

# Keys per split-K chunk when a request is split across threads (a multiple of the block size).
CHUNK_TOKENS = 1024
# Software prefetch distance in blocks (0: none); ``DCPGRAPH_NATIVE_PREFETCH`` overrides.
PREFETCH_BLOCKS = 4


def __getattr__(name: str):
    """``reason`` (why the kernel is unavailable, None if fine or not tried), ``build_seconds``
    (its build/load time in this process) and ``_module``: the extension's current state."""
    attr = {"reason": "reason", "build_seconds": "build_seconds", "_module": "module"}.get(name)
    if attr is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(EXTENSION, attr)


def build_dir() -> Path:
    """The persistent build directory (created on demand by the build)."""
    return EXTENSION.build_dir()


def _load():
    return EXTENSION.load()


def available() -> bool:
    """Whether the native kernel is built and loadable (tries the build once per process)."""
    return EXTENSION.available()


def kv_dtypes() -> tuple[torch.dtype, ...]:
    """KV cache dtypes the built kernel reads (empty when it is unavailable)."""
    mod = _load()
    if mod is None:
        return ()
    return tuple(getattr(torch, name) for name in mod.kv_dtypes())


def supports(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """The inputs this kernel handles: CPU, fp32/bf16 queries, K and V of one dtype the build
    reads, dense K/V rows, matching block/head shapes."""
    return (
        q.dtype in (torch.float32, torch.bfloat16) and k_cache.dtype == v_cache.dtype
        and k_cache.dtype in kv_dtypes()
        and q.device.type == k_cache.device.type == v_cache.device.type == "cpu"
        and q.dim() == 3 and k_cache.dim() == 4 and v_cache.dim() == 4
        and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
        and k_cache.shape[:3] == v_cache.shape[:3] and q.shape[-1] == k_cache.shape[-1]
        and q.shape[1] % k_cache.shape[2] == 0
    )


def native_paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float,
    *,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    chunk_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(out [T, Hq, Dv] in q's dtype, lse [T, Hq] fp32)``, or ``None`` when the block table does
    not cover a row's keys (too short, or an out-of-range id): the caller's checked path then raises.
    fp8 caches need ``k_scales`` (and ``v_scales`` unless the values are a prefix of the keys).

    Raises ``RuntimeError`` if the kernel is unavailable (check :func:`available` first)."""
    mod = _load()
    if mod is None:
        raise RuntimeError(EXTENSION.reason or "native kernel unavailable")
    tq, hq, _ = q.shape
    dv = v_cache.shape[-1]
    out = torch.zeros(tq, hq, dv, dtype=torch.float32)
    lse = torch.full((tq, hq), float("-inf"), dtype=torch.float32)
    lens = kv_lens.to(torch.int64).contiguous()
    if chunk_tokens is None:
        # Split each request's keys so that the (request, KV head, chunk) items keep every thread
        # busy; with one thread (or enough requests x heads) a request is one chunk.
        threads = torch.get_num_threads()
        items = max(1, len(lens)) * k_cache.shape[2]
        longest = int(lens.max()) if lens.numel() else 0
        if threads <= 1 or items >= 4 * threads or longest == 0:
            chunk_tokens = max(longest, 1)
        else:
            splits = -(-4 * threads // items)
            chunk_tokens = max(CHUNK_TOKENS // 4, -(-longest // splits))
    def scales(x):
        return None if x is None else x.to(torch.float32).contiguous()

    ok = mod.paged_decode(
        q.to(torch.float32).contiguous(), k_cache, v_cache, scales(k_scales), scales(v_scales),
        block_table.to(torch.int32).contiguous(),
        cu_seqlens_q.to(torch.int64).contiguous(), lens, float(scale), out, lse, int(chunk_tokens),
        int(os.environ.get("DCPGRAPH_NATIVE_PREFETCH", PREFETCH_BLOCKS)),
    )
    return (out.to(q.dtype), lse) if ok else None
