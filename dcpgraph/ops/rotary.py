"""``dcpgraph.rotary_embedding``: HF's rotary embedding as one op, native on CPU.

HF's Llama-family attention rotates queries and keys with ``x * cos + rotate_half(x) * sin``,
``rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2])``: seven eager ops (two slices, a negation, a
concatenation, two products and a sum), twice a layer. :func:`rotary_reference` is that sequence
(the op's meaning and its kernel off the CPU); ``csrc/rotary.cpp`` does, for bf16, fp16 and fp32
tensors, the same fp32 products and sum with the same three roundings to the tensor's dtype
element by element, so its results equal eager torch's bit for bit. The module registers its C++ function as the op's CPU kernel when it loads
(:func:`native_enabled`, after a self-check); the ``native_rotary`` pass emits the op only then.
Built lazily (:class:`~dcpgraph.ops.native_build.NativeExtension`) without ``-ffast-math`` or
contraction into fused multiply-adds, which would skip a rounding.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .native_build import NativeExtension, SelfCheckedKernel

EXTENSION = NativeExtension(
    "dcpgraph_rotary", Path(__file__).resolve().parent / "csrc" / "rotary.cpp",
    "native rotary kernel", "rotary embeddings run as eager torch ops",
    cflags=("-O3", "-march=native", "-ffp-contract=off"),
)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin


DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # what the native kernel computes (others: eager torch)


def rotary_fake(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _check(mod) -> str | None:
    gen = torch.Generator().manual_seed(0)
    for dtype in DTYPES:
        for heads, tokens, d in ((2, 3, 8), (4, 1, 64)):
            x = (4 * torch.randn(1, tokens, heads, d, generator=gen)).to(dtype).transpose(1, 2)
            cos, sin = torch.randn(2, 1, 1, tokens, d, generator=gen).to(dtype)
            if not torch.equal(mod.rotary_embedding(x, cos, sin), rotary_reference(x, cos, sin)):
                return f"native rotary failed its {dtype} self-check against eager torch"
    return None


KERNEL = SelfCheckedKernel(EXTENSION, _check)


def reason() -> str | None:
    """Why the native kernel is off (None: on, or not tried yet)."""
    return KERNEL.reason


def native_enabled() -> bool:
    """Built, loaded (so registered as the op's CPU kernel) and past its self-check; decided once
    per process. ``DCPGRAPH_NATIVE=0`` says no without building."""
    return KERNEL.enabled()
