"""``dcpgraph.rms_norm_f32``: HF's RMSNorm of an fp32 tensor as one op, native on CPU.

In fp32 HF's ``w * (h * rsqrt(mean(h², -1) + eps)).to(fp32)``, ``h = x.float()``, traces to
eight ops (two casts that return their input), four norms a Qwen3 layer.
:func:`rms_norm_f32_reference` is that sequence (the op's meaning and its kernel off the CPU);
``csrc/rms_norm_f32.cpp`` takes the mean of squares from ATen's own reduction (the same fp32 sums
in the same order) and does the rest, the same IEEE operations, in one pass per row, so on a
contiguous ``x`` its results equal eager torch's bit for bit. The module registers its C++
function as the op's CPU kernel when it loads (:func:`native_enabled`, after a self-check).
Built without ``-ffast-math`` (``1/sqrt`` must stay exact, not an approximate reciprocal root).
"""

from __future__ import annotations

from pathlib import Path

import torch

from .native_build import NativeExtension, SelfCheckedKernel

EXTENSION = NativeExtension(
    "dcpgraph_rms_norm_f32", Path(__file__).resolve().parent / "csrc" / "rms_norm_f32.cpp",
    "native fp32 RMSNorm kernel", "RMSNorm runs as eager torch ops",
    cflags=("-O3", "-march=native", "-fopenmp"),
)


def rms_norm_f32_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rms_norm_f32_fake(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _check(mod) -> str | None:
    gen = torch.Generator().manual_seed(0)
    for shape in ((1, 1, 70), (3, 4, 64), (2, 768)):
        x = 4 * torch.randn(shape, generator=gen)
        w = torch.randn(shape[-1], generator=gen)
        if not torch.equal(mod.rms_norm_f32(x, w, 1e-6), rms_norm_f32_reference(x, w, 1e-6)):
            return "native fp32 RMSNorm failed its self-check against eager torch"
    return None


KERNEL = SelfCheckedKernel(EXTENSION, _check)


def reason() -> str | None:
    """Why the native kernel is off (None: on, or not tried yet)."""
    return KERNEL.reason


def native_enabled() -> bool:
    """Built, loaded (so registered as the op's CPU kernel) and past its self-check; decided once
    per process. ``DCPGRAPH_NATIVE=0`` says no without building."""
    return KERNEL.enabled()
