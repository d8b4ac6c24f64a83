"""``dcpgraph.linear_f32``: ``y = x @ W.T (+ b)`` for fp32 weights, native for few rows on CPU.

A decode step's linears have ``M`` = batch rows and read every weight once, so their floor is the
weight bytes ÷ read bandwidth. torch's CPU fp32 linear reaches that floor for one row (a GEMV) but
packs ``W`` for two or more, which for a weight larger than the cache reads and writes it again: on
a Zen 2 core a 4096×4096 weight took 3.5× longer at ``M = 4`` than at ``M = 1``, which is why a
batched fp32 decode step cost several times a lone one. :func:`linear_f32` sends calls of
1 ≤ M ≤ :data:`MAX_ROWS` rows to ``csrc/linear_f32.cpp`` (AVX2 + FMA register blocks, ``W`` read once
in nn.Linear's row-major layout, fp32 sums) and every other call to
``torch.nn.functional.linear``.

:func:`native_kernel` is the checker: CPU fp32 ``x``, ``W`` and bias, ``W`` 2-D with dense rows,
``x``'s rows (all leading dimensions together) within :data:`MAX_ROWS`, and the kernel built and
past its self-check (:func:`native_enabled`). The result equals torch's fp32 linear up to the order
of the fp32 sums (relative differences of order 1e-6). The kernel is built lazily
(:class:`~dcpgraph.ops.native_build.NativeExtension`); ``DCPGRAPH_NATIVE=0`` keeps it unbuilt.
Once built and self-checked, the module registers its C++ ``linear_f32_op`` as the op's CPU kernel
with the same rule, so a call costs a C++ dispatch.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import torch

from .linear import cpu_linear_rows
from .native_build import NativeExtension

EXTENSION = NativeExtension(
    "dcpgraph_linear_f32", Path(__file__).resolve().parent / "csrc" / "linear_f32.cpp",
    "native fp32 linear kernel", "fp32 linears run on torch's kernel",
)
# Rows up to which the native kernel runs: register blocks take 4 rows per pass over a W block (the
# rest of the rows read it from cache), so W streams from memory once whatever the rows. In isolation
# (benchmarks/linear_f32.py, a weight warm in cache) torch's packed GEMM beat it at M = 16 on a K = 512
# weight, but in a decode step every weight comes from memory: on the 28M-parameter fp32 Qwen3 of the
# vLLM comparison (engine steps A/B in one process, one Zen 2 core) a batch-12/16 step took 0.68-0.74x
# of the step with torch's GEMM beyond 8 rows and a batch-32 step 0.86x.
MAX_ROWS = 32

_state: dict[str, object] = {}
_check_lock = threading.Lock()


def reason() -> str | None:
    """Why the native kernel is off (None: on, or not tried yet)."""
    return _state.get("reason")  # type: ignore[return-value]


def native_enabled() -> bool:
    """Built with AVX2 + FMA and past its self-check against torch; decided once per process."""
    if os.environ.get("DCPGRAPH_NATIVE", "1") == "0":
        _state["reason"] = "native kernels turned off (DCPGRAPH_NATIVE=0)"
        return False
    ok = _state.get("ok")
    if ok is None:
        with _check_lock:
            ok = _state.get("ok")
            if ok is None:
                ok = _state["ok"] = _self_check()
    return bool(ok)


def _self_check() -> bool:
    mod = EXTENSION.load()
    failed = None
    if mod is None:
        failed = EXTENSION.reason or "native fp32 linear kernel unavailable"
    elif not mod.has_kernel():
        failed = "native fp32 linear kernel built without AVX2 + FMA (this CPU lacks them)"
    else:
        failed = _check_kernel(mod.linear_f32)
    _state["reason"] = failed
    if failed is None:
        mod.configure(True, MAX_ROWS)
    return failed is None


def _check_kernel(run) -> str | None:
    """Why ``run`` disagrees with torch's fp32 linear on small odd shapes (None: it agrees)."""
    try:
        gen = torch.Generator().manual_seed(0)
        for m, k, n in ((1, 78, 19), (5, 200, 33), (16, 64, 40), (3, 9, 7)):
            x, w, b = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
            want = torch.nn.functional.linear(x.double(), w.double(), b.double())
            got = torch.empty(m, n)
            if not run(x, w, b, got):
                return "native fp32 linear declined its self-check"
            if not torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max())):
                return "native fp32 linear failed its self-check against an fp64 reference"
    except Exception as exc:  # noqa: BLE001 - a failing kernel is switched off, not fatal
        return f"native fp32 linear self-check raised {type(exc).__name__}: {exc}"
    return None


def native_applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether :func:`linear_f32` runs ``x @ weight.T (+ bias)`` natively (rules in the module docstring)."""
    rows = cpu_linear_rows(x, weight, bias, torch.float32)
    return rows is not None and rows <= MAX_ROWS and native_enabled()


def linear_f32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.nn.functional.linear(x, weight, bias)``, natively where :func:`native_applies`."""
    if not native_applies(x, weight, bias):
        return torch.nn.functional.linear(x, weight, bias)
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], n, dtype=torch.float32)
    if not EXTENSION.module.linear_f32(x2, weight, None if bias is None else bias.contiguous(), out):
        raise RuntimeError("native fp32 linear declined a call its checker accepted")
    return out.view(*x.shape[:-1], n)


def linear_f32_fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))
