"""``dcpgraph.rms_norm_f32``: HF's RMSNorm of an fp32 tensor as one op, native on CPU.

In fp32 HF's ``w * (h * rsqrt(mean(h², -1) + eps)).to(fp32)``, ``h = x.float()``, traces to
eight ops (two casts that return their input), four norms a Qwen3 layer.
:func:`rms_norm_f32_reference` is that sequence (the op's meaning and its kernel off the CPU);
``csrc/rms_norm.cpp`` runs the row loop of ``csrc/rms_norm_rows.h`` for fp32: the mean of
squares from ATen's own reduction (the same fp32 sums in the same order), the rest, the same IEEE
operations, in one pass per row, so on a contiguous ``x`` its results equal eager torch's bit for
bit. The kernel is built lazily and registered as the op's CPU kernel when it loads
(:func:`native_enabled`, after the self-check of :class:`~dcpgraph.ops.rms_norm_kernel.NativeRmsNorm`).
"""

from __future__ import annotations

import torch

from .rms_norm_kernel import NativeRmsNorm
from .rms_norm_kernel import rms_norm_fake as rms_norm_f32_fake

__all__ = ["EXTENSION", "KERNEL", "NATIVE", "native_enabled", "reason", "rms_norm_f32_fake", "rms_norm_f32_reference"]


def rms_norm_f32_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


NATIVE = NativeRmsNorm("rms_norm_f32", torch.float32, "fp32", rms_norm_f32_reference)
EXTENSION, KERNEL = NATIVE.extension, NATIVE.kernel
reason = NATIVE.reason
native_enabled = NATIVE.native_enabled
