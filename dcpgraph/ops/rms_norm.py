"""``dcpgraph.rms_norm_bf16``: HF's RMSNorm of a bf16 tensor as one op, native on CPU.

HF models normalise with ``w * (h * rsqrt(mean(h², -1) + eps)).to(bf16)``, ``h = x.float()``:
eight eager ops and as many temporaries per norm, four norms a Qwen3 layer (49 a step for the
benchmark's 12 layers, ~400 of a step's ~1000 ops). :func:`rms_norm_reference` is that sequence
(the op's meaning and its kernel off the CPU); ``csrc/rms_norm_bf16.cpp`` takes the mean of
squares from ATen's own reduction (the same fp32 sums in the same order) and does the rest, the
same IEEE operations and two bf16 roundings, in one pass per row, so its results equal eager
torch's bit for bit. The module registers its C++ function as the op's CPU kernel when it loads
(:func:`native_enabled`, after a self-check).
Built lazily (:class:`~dcpgraph.ops.native_build.NativeExtension`) without ``-ffast-math``:
GCC would otherwise turn ``1/sqrt`` into an approximate reciprocal square root.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .native_build import NativeExtension, SelfCheckedKernel

EXTENSION = NativeExtension(
    "dcpgraph_rms_norm_bf16", Path(__file__).resolve().parent / "csrc" / "rms_norm_bf16.cpp",
    "native bf16 RMSNorm kernel", "RMSNorm runs as eager torch ops",
    cflags=("-O3", "-march=native", "-fopenmp"),
)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.to(torch.float32)
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rms_norm_fake(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _check(mod) -> str | None:
    gen = torch.Generator().manual_seed(0)
    for shape in ((1, 1, 70), (3, 4, 64)):
        x = (4 * torch.randn(shape, generator=gen)).bfloat16()
        w = torch.randn(shape[-1], generator=gen).bfloat16()
        if not torch.equal(mod.rms_norm_bf16(x, w, 1e-6), rms_norm_reference(x, w, 1e-6)):
            return "native bf16 RMSNorm failed its self-check against eager torch"
    return None


KERNEL = SelfCheckedKernel(EXTENSION, _check)


def reason() -> str | None:
    """Why the native kernel is off (None: on, or not tried yet)."""
    return KERNEL.reason


def native_enabled() -> bool:
    """Built, loaded (so registered as the op's CPU kernel) and past its self-check; decided once
    per process. ``DCPGRAPH_NATIVE=0`` says no without building."""
    return KERNEL.enabled()
