"""The native RMSNorm kernels, one build for every activation dtype, each self-checked.

``csrc/rms_norm.cpp`` instantiates the row loop of ``csrc/rms_norm_rows.h`` for each dtype's op
(``dcpgraph.rms_norm_bf16``, ``dcpgraph.rms_norm_f32``) and registers them as the ops' CPU kernels
when the module loads. :data:`EXTENSION` builds it once per machine
(:class:`~dcpgraph.ops.native_build.NativeExtension`, without ``-ffast-math``: GCC would otherwise
turn ``1/sqrt`` into an approximate reciprocal square root); :class:`NativeRmsNorm` lets one op's
kernel serve only after its own self-check (a failed check turns that op's rewrite off, not the
other's): on every shape of :data:`CHECK_SHAPES`, ``x = 4·N(0, 1)`` and ``w = N(0, 1)`` cast to the
dtype (one generator seeded 0), the kernel equals the op's eager reference bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from .native_build import NativeExtension, SelfCheckedKernel

CSRC = Path(__file__).resolve().parent / "csrc"
CFLAGS = ("-O3", "-march=native", "-fopenmp")  # no -ffast-math: 1/sqrt stays exact
CHECK_SHAPES = ((1, 1, 70), (3, 4, 64), (2, 768))

Reference = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
EXTENSION = NativeExtension("dcpgraph_rms_norm", CSRC / "rms_norm.cpp", "native RMSNorm kernels",
                            "RMSNorm runs as eager torch ops", cflags=CFLAGS, headers=(CSRC / "rms_norm_rows.h",))


def rms_norm_fake(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Either op's shape function: a contiguous tensor like ``x``."""
    return torch.empty_like(x, memory_format=torch.contiguous_format)


class NativeRmsNorm:
    """The kernel of the op ``op`` (``"rms_norm_bf16"``) on ``dtype`` activations, ``label``
    naming the dtype in messages (``"bf16"``), checked against ``reference`` (the op's meaning)."""

    def __init__(self, op: str, dtype: torch.dtype, label: str, reference: Reference):
        self.op, self.dtype, self.reference = op, dtype, reference
        self.what = f"native {label} RMSNorm kernel"
        self.extension = EXTENSION
        self.kernel = SelfCheckedKernel(self.extension, self.check)

    def check(self, module) -> str | None:
        """None when the built ``module``'s function equals the reference on every check shape."""
        gen = torch.Generator().manual_seed(0)
        for shape in CHECK_SHAPES:
            x = (4 * torch.randn(shape, generator=gen)).to(self.dtype)
            w = torch.randn(shape[-1], generator=gen).to(self.dtype)
            if not torch.equal(getattr(module, self.op)(x, w, 1e-6), self.reference(x, w, 1e-6)):
                return f"{self.what} failed its self-check against eager torch"
        return None

    def reason(self) -> str | None:
        """Why the native kernel is off (None: on, or not tried yet)."""
        return self.kernel.reason

    def native_enabled(self) -> bool:
        """Built, loaded (so registered as the op's CPU kernel) and past its self-check; decided
        once per process. ``DCPGRAPH_NATIVE=0`` says no without building."""
        return self.kernel.enabled()
