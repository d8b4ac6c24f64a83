"""``dcpgraph.rms_norm_bf16``: HF's RMSNorm of a bf16 tensor as one op, native on CPU.

HF models normalise with ``w * (h * rsqrt(mean(h², -1) + eps)).to(bf16)``, ``h = x.float()``:
eight eager ops and as many temporaries per norm, four norms a Qwen3 layer (49 a step for the
benchmark's 12 layers, ~400 of a step's ~1000 ops). :func:`rms_norm_reference` is that sequence
(the op's meaning and its kernel off the CPU); ``csrc/rms_norm.cpp`` runs the row loop of
``csrc/rms_norm_rows.h`` for bf16: the mean of squares from ATen's own reduction (the same fp32
sums in the same order), the rest, the same IEEE operations and two bf16 roundings, in one pass per
row, so its results equal eager torch's bit for bit. The kernel is built lazily and registered as
the op's CPU kernel when it loads (:func:`native_enabled`, after the self-check of
:class:`~dcpgraph.ops.rms_norm_kernel.NativeRmsNorm`).
"""

from __future__ import annotations

import torch

from .rms_norm_kernel import NativeRmsNorm, rms_norm_fake

__all__ = ["EXTENSION", "KERNEL", "NATIVE", "native_enabled", "reason", "rms_norm_fake", "rms_norm_reference"]


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.to(torch.float32)
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


NATIVE = NativeRmsNorm("rms_norm_bf16", torch.bfloat16, "bf16", rms_norm_reference)
EXTENSION, KERNEL = NATIVE.extension, NATIVE.kernel
reason = NATIVE.reason
native_enabled = NATIVE.native_enabled
