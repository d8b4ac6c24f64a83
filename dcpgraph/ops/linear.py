"""``dcpgraph.linear_bf16``: ``y = x @ W.T (+ b)`` for bf16 weights, native for few rows on CPU.

A decode step's linears have ``M`` = batch rows and read every weight once, so their floor is the
weight bytes ÷ read bandwidth. torch's CPU bf16 linear for a few rows does not stream its weights
at memory speed (measured here on one core: 60-75% of read bandwidth at M = 1, 57-80% at M = 16),
so :func:`linear_bf16` sends those calls to ``csrc/linear_bf16.cpp`` (W read once, in place, in
nn.Linear's row-major layout; fp32 accumulation; one bf16 rounding of ``acc + b``):

* ``"amx"`` for 1 ≤ M ≤ :data:`MAX_ROWS` and even K where the CPU has AMX-BF16 and the OS grants
  it: Y^T = W · X^T on 16×16 tiles (90-100% of read bandwidth at M = 1..16 on 1024×4096 and
  2816×1024 weights, against torch's 57-80%);
* ``"dot"`` (MB×NB register blocks) for 1 ≤ M ≤ :func:`dot_max_rows` otherwise: AVX512-BF16 dot
  products up to :data:`DOT_MAX_ROWS` rows (compute-bound beyond: 16 multiply-adds per weight run
  at ~35%), or, on CPUs with AVX2 + FMA but no AVX512-BF16 (AMD Zen 1-3, older Intel), bf16
  widened to fp32 in registers with fp32 FMAs up to :data:`DOT_MAX_ROWS_AVX2` (torch's bf16
  linear there is slower at every such M);
* ``"fp32"`` for more than :data:`MAX_ROWS` rows (prefill) on AVX2 builds (:func:`fp32_beyond`):
  ``x`` and slabs of ``W`` widened to fp32 for torch's fp32 GEMM, the output rounded once to bf16
  (torch's bf16 GEMM there has no bf16 dot products to use and runs 2-4.5x slower);
* torch's ``torch.nn.functional.linear`` for everything else (prefill elsewhere, fp32, other devices).

:func:`native_kernel` is the checker: CPU tensors, bf16 ``x`` and ``W``, ``W`` 2-D with dense
rows, ``x``'s rows (all leading dimensions together) within the limits above, a bf16 bias of
``N`` elements or none, and the kernel built and past its self-check (:func:`native_enabled`).
The result then equals torch's bf16 linear within bf16 rounding of the output (both accumulate
in fp32; the order of the sums may differ). The kernel is built lazily like the paged one
(:class:`~dcpgraph.ops.native_build.NativeExtension`); ``DCPGRAPH_NATIVE=0`` keeps it unbuilt.

Once built and self-checked, the module registers its C++ ``linear_bf16_op`` as the op's CPU
kernel (the same rule, parameters from here via ``configure``), so a call costs a C++ dispatch
(~3 µs, as torch's linear) instead of a Python kernel's (~20 µs, ×85 linears a step);
:func:`linear_bf16` below is the op's kernel until then and on other devices.
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
    headers=(Path(__file__).resolve().parent / "csrc" / "line_aligned.h",),
)
# Rows up to which the AMX kernel runs (one 16-column B tile: decode batches); more go to torch.
MAX_ROWS = 16
# Rows up to which the register-block ("dot") kernel beats torch (odd K, or no AMX), per its
# instruction set. AVX512-BF16 dot products: 3 (compute-bound beyond). AVX2 + FMA on bf16 widened to
# fp32: every row the op takes (MAX_ROWS), since torch's bf16 linear on AVX2 slows in proportion to
# the rows (measured in one run on an AMD EPYC (Zen 2) core, 4096x4096 weights: the kernel 20.6 GB/s
# at M = 1 and 4.0 at M = 16, torch 6.9 and 0.5).
DOT_MAX_ROWS = 3
DOT_MAX_ROWS_AVX2 = MAX_ROWS
# Software prefetch distance along each W row, in bytes (0: none), per kernel: measured best on a
# Sapphire Rapids core (AMX streams 16-32 rows at once and its prefetch only got in the way), and
# for the AVX2 dot kernel's spread row blocks on a Zen 2 core (K = 1024, M = 1: 512 bytes ahead
# 20.3 GB/s, none 18.5, 1 KiB 19.5).
PREFETCH_BYTES = {"amx": 0, "dot": 512}

_state: dict[str, object] = {}
_check_lock = threading.Lock()


def reason() -> str | None:
    """Why the native kernel is off (None: on, or not tried yet)."""
    return _state.get("reason")  # type: ignore[return-value]


def native_enabled() -> bool:
    """Built (with AVX512-BF16 or AVX2 + FMA), and its self-check against an fp32 reference passed;
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
    isa = mod.dot_isa()
    if not isa:
        return _off("native bf16 linear kernel built without AVX512-BF16 or AVX2 + FMA (this CPU lacks both)")
    _state["isa"] = isa
    _state["amx"] = False
    failed = _check_kernel("dot", mod.linear_bf16)
    if failed:
        return _off(failed)
    if mod.has_amx():
        failed = _check_kernel("amx", mod.linear_bf16_amx)
        _state["amx"] = failed is None
        _state["amx_reason"] = failed  # the dot kernel still runs
    _state["reason"] = None
    prefetch = os.environ.get("DCPGRAPH_LINEAR_PREFETCH")
    mod.configure(True, bool(_state["amx"]), MAX_ROWS, dot_max_rows(),
                  *(int(prefetch if prefetch is not None else PREFETCH_BYTES[k]) for k in ("amx", "dot")),
                  fp32_beyond())
    return True


def _check_kernel(name: str, run) -> str | None:
    """Why ``run`` fails against an fp32 reference on small odd shapes (None: it passes)."""
    try:
        gen = torch.Generator().manual_seed(0)
        for m, k, n in ((1, 78, 19), (5, 200, 33), (16, 64, 40)):
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
            w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
            b = torch.randn(n, generator=gen)
            want = x.float() @ w.float().T + b
            got = torch.empty(m, n, dtype=torch.bfloat16)
            if not run(x, w, b, got, 0):
                return f"native bf16 linear ({name}) declined its self-check"
            if not torch.allclose(got.float(), want, rtol=1e-2, atol=1e-2 * float(want.abs().max())):
                return f"native bf16 linear ({name}) failed its self-check against an fp32 reference"
    except Exception as exc:  # noqa: BLE001 - a failing kernel is switched off, not fatal
        return f"native bf16 linear ({name}) self-check raised {type(exc).__name__}: {exc}"
    return None


def fp32_beyond() -> bool:
    """Whether calls of more than :data:`MAX_ROWS` rows run in fp32 (``"fp32"``): where the build has
    no bf16 dot products (AVX2), torch's bf16 GEMM is several times slower than its fp32 GEMM plus
    widening W (measured on one Zen 2 core, 4096x4096: 2.2x at 16 rows, 4.5x at 256)."""
    return _state.get("isa") == "avx2"


def dot_max_rows() -> int:
    """Rows up to which the built register-block kernel runs (its instruction set's limit)."""
    return DOT_MAX_ROWS_AVX2 if _state.get("isa") == "avx2" else DOT_MAX_ROWS


def cpu_linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> int | None:
    """The rows of ``x`` (all leading dimensions together) where ``x``, ``weight`` and ``bias`` are
    CPU tensors of ``dtype`` a native few-row linear can read (``weight`` 2-D with dense rows and
    ``K > 0`` columns, ``x``'s last dimension ``K``, a bias of ``N`` elements or none); None otherwise."""
    if not (x.dtype == weight.dtype == dtype and x.device.type == weight.device.type == "cpu"):
        return None
    if weight.dim() != 2 or weight.stride(1) != 1 or x.dim() == 0 or x.shape[-1] != weight.shape[1]:
        return None
    if bias is not None and (bias.dtype != dtype or bias.device.type != "cpu" or bias.dim() != 1
                             or bias.numel() != weight.shape[0]):
        return None
    k = weight.shape[1]
    rows = x.numel() // max(1, k)
    return rows if rows > 0 and k > 0 else None


def native_kernel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> str | None:
    """``"amx"``, ``"dot"``, ``"fp32"`` or ``None`` (torch): which kernel :func:`linear_bf16` runs
    ``x @ weight.T (+ bias)`` on (rules in the module docstring)."""
    rows = cpu_linear_rows(x, weight, bias, torch.bfloat16)
    if rows is None or not native_enabled():
        return None
    k = weight.shape[1]
    if rows > MAX_ROWS:
        return "fp32" if fp32_beyond() else None
    if k % 2 == 0 and _state.get("amx"):
        return "amx"
    return "dot" if rows <= dot_max_rows() else None


def native_applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether :func:`linear_bf16` runs natively (:func:`native_kernel` is not None)."""
    return native_kernel(x, weight, bias) is not None


def linear_bf16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.nn.functional.linear(x, weight, bias)``, through the native kernel
    :func:`native_kernel` picks."""
    kernel = native_kernel(x, weight, bias)
    if kernel is None:
        return torch.nn.functional.linear(x, weight, bias)
    if kernel == "fp32":
        return EXTENSION.module.linear_fp32(x, weight, bias)
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], n, dtype=torch.bfloat16)
    fp32_bias = None if bias is None else bias.to(torch.float32).contiguous()
    prefetch = int(os.environ.get("DCPGRAPH_LINEAR_PREFETCH", PREFETCH_BYTES[kernel]))
    run = EXTENSION.module.linear_bf16_amx if kernel == "amx" else EXTENSION.module.linear_bf16
    if not run(x2, weight, fp32_bias, out, prefetch):
        raise RuntimeError(f"native bf16 linear ({kernel}) declined a call its checker accepted")
    return out.view(*x.shape[:-1], n)


def linear_bf16_fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))
