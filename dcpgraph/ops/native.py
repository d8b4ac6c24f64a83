"""Optional native (C++) kernel for paged decode attention, built lazily on first use.

:func:`native_paged_decode` computes what :func:`dcpgraph.ops.paged.paged_partial_attention`
does without ``kv_bound`` (row ``r``'s queries attend to its first ``kv_lens[r]`` cached tokens),
reading K and V **in place through the block table** (no gather copy, so a scattered table costs
what a contiguous one does). KV caches of fp32, bf16 or float8_e4m3fn with its per-group scales
(:mod:`dcpgraph.ops.quant`; the group size is passed to the kernel) are read as stored (bf16/fp8
need an AVX-512 or AVX2 + FMA build, ``csrc/simd_f32.h``: :func:`kv_dtypes`). fp32 queries are computed in fp32, stored elements
converted in registers. bf16 queries (a bf16 model) over a bf16/fp8 cache take the AMX-BF16 path
(``csrc/paged_decode_amx.h``: bf16 products with fp32 accumulation and softmax, the softmax weights
rounded to bf16 for the value product, within :data:`AMX_OUT_TOL` / :data:`AMX_LSE_TOL` of fp32)
when :func:`amx_enabled`, else they are computed in fp32 as well. The output is returned in the
query's dtype, the LSE in fp32. For each (request, KV head, key chunk) the ``G``
query heads of the KV head are processed together, so every K/V row is read once per KV head,
with an online softmax over key blocks; chunks of one request are merged by LSE (split-K, so one
long request still uses every thread). Source: ``csrc/paged_decode.cpp`` (and its AMX header).

The extension is built lazily by :class:`~dcpgraph.ops.native_build.NativeExtension` (persistent
build directory keyed by the source and flags, never raises, ``reason`` when unavailable);
:data:`reason`, :data:`build_seconds` and :func:`build_dir` are this kernel's.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .native_build import STALE_LOCK_SECONDS, NativeExtension, clear_stale_lock
from .quant import FP8_SCALE_GROUP as _FP8_SCALE_GROUP

_SRC = Path(__file__).resolve().parent / "csrc" / "paged_decode.cpp"
_HEADERS = tuple(_SRC.parent / h for h in ("paged_decode_amx.h", "amx_packed.h", "amx_registers.h", "amx_prefetch.h",
                                             "amx_operands.h", "kv_cache_write.h", "line_aligned.h", "merge_lse.h",
                                             "simd_f32.h"))  # included
EXTENSION = NativeExtension("dcpgraph_paged_decode", _SRC, "native paged-decode kernel", "decode runs on the torch path",
                            headers=_HEADERS)
_clear_stale_lock = clear_stale_lock
__all__ = ["AMX_KV_DTYPES", "STALE_LOCK_SECONDS", "amx_enabled", "available", "build_dir", "kv_dtypes",
           "native_paged_decode"]

# Software prefetch distance in blocks (0: none); ``DCPGRAPH_NATIVE_PREFETCH`` overrides.
PREFETCH_BLOCKS = 4

# KV dtypes whose caches bf16 queries read through the AMX-BF16 path (``csrc/paged_decode_amx.h``).
AMX_KV_DTYPES = (torch.bfloat16, torch.float8_e4m3fn)
amx_reason: str | None = None  # why bf16 queries last took the fp32 path instead of AMX (None: they did not)
_amx_state: dict = {}  # per KV dtype: the AMX path's self-check result (and ("reason", dtype): why it failed)


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
    """KV cache dtypes the built kernel reads (empty when it is unavailable); asked of a module
    once (it is called on every decode dispatch)."""
    mod = _load()
    if mod is None:
        return ()
    cached = _kv_dtypes_of.get(id(mod))
    if cached is None:
        cached = _kv_dtypes_of[id(mod)] = tuple(getattr(torch, name) for name in mod.kv_dtypes())
    return cached


_kv_dtypes_of: dict[int, tuple[torch.dtype, ...]] = {}


def amx_enabled(kv_dtype: torch.dtype) -> bool:
    """Whether bf16 queries over a ``kv_dtype`` cache take the AMX-BF16 path (bf16 products, fp32
    accumulation and softmax, the softmax weights rounded to bf16 for the value product). Needs a
    build with AMX code, the OS's grant of the tile state (asked once per process), a bf16/fp8
    cache, ``DCPGRAPH_NATIVE_AMX`` not ``0``, and a passed self-check against a dense fp32 reference
    (once per KV dtype and process). When it returns ``False``, :data:`amx_reason` says why and
    bf16 queries are converted to fp32 for the exact fp32 path."""
    global amx_reason
    if os.environ.get("DCPGRAPH_NATIVE_AMX", "1") == "0":
        amx_reason = "the AMX path is disabled by DCPGRAPH_NATIVE_AMX=0"
        return False
    if kv_dtype not in AMX_KV_DTYPES:
        amx_reason = f"the AMX path reads {AMX_KV_DTYPES} caches, not {kv_dtype}"
        return False
    mod = _load()
    if mod is None or kv_dtype not in kv_dtypes():
        amx_reason = EXTENSION.reason or f"this native build reads {kv_dtypes()} KV caches only"
        return False
    if _amx_state.get(kv_dtype):  # passed everything below once in this process
        return True
    from .quant import FP8_SCALE_GROUP, is_fp8

    if is_fp8(kv_dtype) and FP8_SCALE_GROUP % 32:
        amx_reason = f"the AMX path needs an fp8 scale group that is a multiple of 32, not {FP8_SCALE_GROUP}"
        return False
    status = mod.amx_status()
    if status:
        amx_reason = f"the AMX path is unavailable: {status}"
        return False
    ok = _amx_state.get(kv_dtype)
    if ok is None:
        ok = _amx_state[kv_dtype] = _amx_self_check(kv_dtype)
    if not ok:
        amx_reason = _amx_state.get(("reason", kv_dtype))
    return ok


# The AMX path's stated accuracy against fp32 attention on the same bf16/fp8 values: the output
# carries the bf16 rounding of the softmax weights, the LSE only fp32 accumulation order.
AMX_OUT_TOL = 2e-2
AMX_LSE_TOL = 1e-4


def dense_reference(q, k_values, v_values, block_table, cu_seqlens_q, kv_lens, scale):
    """fp32 ``(out, lse)``: each row's keys gathered through its table and attended densely in
    float64 with plain torch ops (the same arithmetic as the tests'
    :func:`dcpgraph.testing.reference.dense_attention`, kept here so that ops never imports
    :mod:`dcpgraph.testing`) — the independent check of the AMX path (``k_values``/``v_values``:
    the caches' exact values)."""
    tq, hq, _ = q.shape
    block, hkv = k_values.shape[1], k_values.shape[2]
    out = torch.zeros(tq, hq, v_values.shape[-1])
    lse = torch.full((tq, hq), float("-inf"))
    cu = cu_seqlens_q.tolist()
    for r, n in enumerate(kv_lens.tolist()):
        if n <= 0 or cu[r + 1] == cu[r]:
            continue
        ids = block_table[r, : -(-n // block)].to(torch.int64)
        k = k_values[ids].reshape(-1, hkv, k_values.shape[-1])[:n]
        v = v_values[ids].reshape(-1, hkv, v_values.shape[-1])[:n]
        o, l_ = _dense_rows(q[cu[r] : cu[r + 1]], k, v, scale)
        out[cu[r] : cu[r + 1]], lse[cu[r] : cu[r + 1]] = o.float(), l_.float()
    return out, lse


def _dense_rows(q, k, v, scale):
    """``softmax(scale·q·kᵀ)·v`` and the scores' logsumexp in float64, every query seeing every key
    (GQA by ``repeat_interleave``): ``q [T, Hq, D]``, ``k [S, Hkv, D]``, ``v [S, Hkv, Dv]``."""
    group = q.shape[1] // k.shape[1]
    qd = q.double().transpose(0, 1)
    kd = k.double().repeat_interleave(group, dim=1).transpose(0, 1)
    vd = v.double().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = scale * qd @ kd.transpose(1, 2)  # [Hq, T, S], S >= 1 here
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.softmax(scores, dim=-1) @ vd
    return out.transpose(0, 1), lse.transpose(0, 1)


def _amx_self_check(kv_dtype: torch.dtype) -> bool:
    """A tiny case through the AMX path against :func:`dense_reference`: staged and in-place key
    rows, separate and prefix-view values, value widths off the tile grid, an empty row, lengths
    off the block grid, two query-row groups (20 heads), split-K chunks."""
    from . import quant

    try:
        gen = torch.Generator().manual_seed(4321)
        nb, block, hkv, d, dv, hq = 10, 16, 2, 64, 48, 20
        k = torch.randn(nb, block, hkv, d, generator=gen)
        v = torch.randn(nb, block, hkv, dv, generator=gen)
        if quant.is_fp8(kv_dtype):
            (k, ks), (v, vs) = (quant.quantize_fp8(x.view(-1, hkv, x.shape[-1])) for x in (k, v))
            k, ks = k.view(nb, block, hkv, d), ks.view(nb, block, hkv, -1)
            v, vs = v.view(nb, block, hkv, dv), vs.view(nb, block, hkv, -1)
            k_exact, v_exact = quant.dequantize_fp8(k, ks, torch.float32), quant.dequantize_fp8(v, vs, torch.float32)
        else:
            k, v, ks, vs = k.to(kv_dtype), v.to(kv_dtype), None, None
            k_exact, v_exact = k.float(), v.float()
        table = torch.randperm(nb, generator=gen)[:9].view(3, 3).to(torch.int32)
        lens = torch.tensor([0, 21, 45])
        cu = torch.arange(4)
        q = torch.randn(3, hq, d, generator=gen).to(torch.bfloat16)
        for vals, vscales, v_ref in ((v, vs, v_exact), (k[..., :dv], None, k_exact[..., :dv])):
            ref = dense_reference(q, k_exact, v_ref, table, cu, lens, 0.3)
            got = native_paged_decode(q, k, vals, table, cu, lens, 0.3, k_scales=ks, v_scales=vscales,
                                      chunk_tokens=32, amx=True)
            if got is None or not (torch.allclose(got[0].float(), ref[0], atol=AMX_OUT_TOL, rtol=AMX_OUT_TOL)
                                   and torch.equal(torch.isinf(got[1]), torch.isinf(ref[1]))
                                   and torch.allclose(got[1], ref[1], atol=AMX_LSE_TOL, rtol=AMX_LSE_TOL)):
                _amx_state[("reason", kv_dtype)] = f"the AMX path failed its {kv_dtype} self-check"
                return False
    except Exception as exc:  # noqa: BLE001 - a broken AMX path only disables itself
        _amx_state[("reason", kv_dtype)] = f"the AMX {kv_dtype} self-check raised {type(exc).__name__}: {exc}"
        return False
    return True


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
    amx: bool | None = None,
    kv_bound: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(out [T, Hq, Dv] in q's dtype, lse [T, Hq] fp32)``, or ``None`` when the inputs are not the
    kernel's (CPU tensors, fp32/bf16 queries, K and V of one dtype :func:`kv_dtypes` lists, dense
    K/V rows, matching block/head shapes: checked in C++) or the block table does not cover a row's keys (too short, or an
    out-of-range id): the caller's checked path then runs, and raises for the latter.
    fp8 caches need ``k_scales`` (and ``v_scales`` unless the values are a prefix of the keys).
    bf16 queries take the AMX path when :func:`amx_enabled` (``amx=True`` forces it, ``False``
    forbids it), else they are converted to fp32 and computed exactly in fp32. ``kv_bound`` (one
    per query token: it sees keys ``j < kv_bound[t]``, a chunked prefill's causal mask): the AMX
    path applies it per query row (a request's query rows go 256 at a time over the keys any of
    them sees); the fp32 path takes it as the row's length, so there every row must have at most
    one query (``None`` otherwise: :mod:`dcpgraph.ops.paged` then gives each query a row).

    Raises ``RuntimeError`` if the kernel is unavailable (check :func:`available` first)."""
    mod = _load()
    if mod is None:
        raise RuntimeError(EXTENSION.reason or "native kernel unavailable")
    if amx is None:
        amx = q.dtype == torch.bfloat16 and amx_enabled(k_cache.dtype)
    # Checks, index conversions, the split-K chunking and the outputs are the C++ entry's: this
    # runs once per attention layer and decode step, where Python costs more than the kernel.
    return mod.paged_attention(q, k_cache, v_cache, k_scales, v_scales, block_table, cu_seqlens_q, kv_lens, kv_bound,
                               float(scale), amx, 0 if chunk_tokens is None else int(chunk_tokens), _prefetch_blocks(),
                               _FP8_SCALE_GROUP)


def _prefetch_blocks() -> int:
    value = os.environ.get("DCPGRAPH_NATIVE_PREFETCH")
    return PREFETCH_BLOCKS if value is None else int(value)
