"""``dcpgraph.linear_bf16``: ``y = x @ W.T (+ b)`` for bf16 weights, native for few rows on CPU.

A decode step's linears have ``M`` = batch rows and read every weight once, so their floor is the
weight bytes ÷ read bandwidth. torch's CPU bf16 linear for a few rows does not stream its weights
at memory speed (a bf16 decode step took about as long as the fp32 one reading twice the bytes),
so :func:`linear_bf16` sends those calls to an AVX512-BF16 kernel (``csrc/linear_bf16.cpp``: W
read once in its own row-major layout, fp32 accumulation, one bf16 rounding of ``acc + b``)
and everything else to ``torch.nn.functional.linear``.

:func:`native_applies` is the checker: CPU tensors, bf16 ``x`` and ``W``, ``W`` 2-D with dense
rows, ``x``'s rows (all leading dimensions together) at most :data:`MAX_ROWS`, a bias of ``N``
elements or none, and the kernel built and past its self-check (:func:`native_enabled`). The
result then equals torch's bf16 linear within bf16 rounding of the output (both accumulate in
fp32; the order of the sums differs). The kernel is built lazily like the paged one
(:class:`~dcpgraph.ops.native_build.NativeExtension`); ``DCPGRAPH_NATIVE=0`` turns it off.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import torch

from .native_build import NativeExtension

EXTENSION = NativeExtension(
    "dcpgraph_linear_bf16", Path(__file__).resolve().parent / "csrc" / "linear_bf16.cpp",
    "native bf16 linear kernel", "bf16 linears run on torch's kernel",
)
# Rows up to which the native kernel runs (decode batches); more rows go to torch, whose blocked
# GEMM reuses each weight across rows.
MAX_ROWS = 16
# Software prefetch distance along each W row, in bytes (0: none); DCPGRAPH_LINEAR_PREFETCH overrides.
PREFETCH_BYTES = 512

_state: dict[str, object] = {}
_check_lock = threading.Lock()


def reason() -> str | None:
    """Why the native kernel is off (None: on, or not tried yet)."""
    return _state.get("reason")  # type: ignore[return-value]


def native_enabled() -> bool:
    """Built, on an AVX512-BF16 build, and its self-check against an fp32 reference passed;
    decided once per process (the reason when not is in :func:`reason`)."""
    if os.environ.get("DCPGRAPH_NATIVE", "1") == "0":
        return _off("native kernels turned off (DCPGRAPH_NATIVE=0)")
    ok = _state.get("ok")
    if ok is None:
        with _check_lock:
            ok = _state.get("ok")
            if ok is None:
                ok = _state["ok"] = _self_check()
    return bool(ok)


def _off(why: str) -> bool:
    _state["reason"] = why
    return False


def _self_check() -> bool:
    mod = EXTENSION.load()
    if mod is None:
        return _off(EXTENSION.reason or "native bf16 linear kernel unavailable")
    if not mod.has_bf16_dot():
        return _off("native bf16 linear kernel built without AVX512-BF16 (this CPU lacks it)")
    try:
        gen = torch.Generator().manual_seed(0)
        for m, k, n in ((1, 77, 19), (5, 200, 33)):
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
            w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
            b = torch.randn(n, generator=gen)
            want = x.float() @ w.float().T + b
            got = torch.empty(m, n, dtype=torch.bfloat16)
            if not mod.linear_bf16(x, w, b, got, 0):
                return _off("native bf16 linear kernel declined its self-check")
            if not torch.allclose(got.float(), want, rtol=1e-2, atol=1e-2 * float(want.abs().max())):
                return _off("native bf16 linear kernel failed its self-check against an fp32 reference")
    except Exception as exc:  # noqa: BLE001 - a failing kernel is switched off, not fatal
        return _off(f"native bf16 linear self-check raised {type(exc).__name__}: {exc}")
    _state["reason"] = None
    return True


def native_applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether :func:`linear_bf16` runs ``x @ weight.T (+ bias)`` natively (module docstring)."""
    if not (x.dtype == weight.dtype == torch.bfloat16 and x.device.type == weight.device.type == "cpu"):
        return False
    if weight.dim() != 2 or weight.stride(1) != 1 or x.dim() == 0 or x.shape[-1] != weight.shape[1]:
        return False
    if bias is not None and (bias.dtype != torch.bfloat16 or bias.device.type != "cpu" or bias.numel() != weight.shape[0] or bias.dim() != 1):
        return False
    rows = x.numel() // max(1, x.shape[-1])
    return 0 < rows <= MAX_ROWS and weight.shape[1] > 0 and native_enabled()


def linear_bf16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.nn.functional.linear(x, weight, bias)``, through the native kernel where
    :func:`native_applies`."""
    if not native_applies(x, weight, bias):
        return torch.nn.functional.linear(x, weight, bias)
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], n, dtype=torch.bfloat16)
    fp32_bias = None if bias is None else bias.to(torch.float32).contiguous()
    prefetch = int(os.environ.get("DCPGRAPH_LINEAR_PREFETCH", PREFETCH_BYTES))
    EXTENSION.module.linear_bf16(x2, weight, fp32_bias, out, prefetch)
    return out.view(*x.shape[:-1], n)


def linear_bf16_fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))
