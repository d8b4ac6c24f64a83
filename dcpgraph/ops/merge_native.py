"""``merge_attention`` and ``rescale_to_global`` on CPU by the native extension's one-pass kernels
(``csrc/merge_lse.h``: one row-LSE routine for both, so a rank's global LSE from either is the same
bit for bit).

It serves once the extension is loaded in this process (a merge never builds it) and it agreed
with :func:`~dcpgraph.ops.merge.merge_attention_reference` on :func:`_merge_check`'s cases;
otherwise, and for inputs it does not take (other devices, more than 64 partials, non-float
dtypes), the reference runs. The two agree to rounding: the
native kernel's ``exp``/``log`` are the C library's, the reference's torch's vectorised ones, so
an output may differ in its last bit; the edge rules (empty shards, NaN and +inf LSEs, NaN outputs
of weight 0) are the same bit for bit.
"""

from __future__ import annotations

import torch

from . import native
from .merge import merge_attention_reference, rescale_to_global_reference
from .native_build import SelfCheckedKernel

# Output and LSE tolerance of the self-check (fp32 and fp64 partials; bf16/fp16 outputs one ulp).
CHECK_TOL = 1e-6


def _merge_check(module) -> str | None:
    """The native merge against the reference: random partials, an empty shard (−inf), NaN and +inf
    LSEs, a NaN output of a shard whose weight is 0, a row of only empty shards, N = 1..5, fp32,
    fp64, bf16 and fp16 outputs, fp32, fp64 and bf16 LSEs, a non-contiguous input."""
    gen = torch.Generator().manual_seed(5)
    for n, dtype, lse_dtype in ((1, torch.float32, torch.float32), (3, torch.float32, torch.float32),
                                (5, torch.bfloat16, torch.float32), (2, torch.float16, torch.float32),
                                (4, torch.float64, torch.float64), (3, torch.bfloat16, torch.float64),
                                (2, torch.float32, torch.bfloat16)):
        outs = torch.randn(n, 4, 6, 33, generator=gen).to(dtype)
        lses = (torch.randn(n, 4, 6, generator=gen) * 20).to(lse_dtype)
        if n > 1:
            lses[0, 0, 0] = float("-inf")
            outs[0, 0, 0, 3] = float("nan")  # weight 0: contributes nothing
            lses[1, 1, 2] = float("nan")
            lses[-1, 2, 1] = float("inf")
            lses[:, 3, 5] = float("-inf")  # every shard empty: (0, −inf)
        cases = [(outs, lses), (outs.transpose(1, 2), lses.transpose(1, 2))]
        for o, lse in cases:
            got = module.merge_attention(o, lse)
            if got is None:
                return f"the native merge declined {dtype} outputs with {lse_dtype} LSEs"
            ref = merge_attention_reference(o, lse)
            if got[0].dtype != ref[0].dtype or got[1].dtype != ref[1].dtype or got[0].shape != ref[0].shape:
                return "the native merge's outputs differ in dtype or shape from the reference's"
            tol = CHECK_TOL if dtype in (torch.float32, torch.float64) else (1e-2 if dtype == torch.bfloat16 else 1e-3)
            if not (torch.equal(got[0].isnan(), ref[0].isnan()) and torch.equal(got[1].isinf(), ref[1].isinf())
                    and torch.allclose(got[0].double(), ref[0].double(), rtol=tol, atol=tol, equal_nan=True)
                    and torch.allclose(got[1].double(), ref[1].double(), rtol=CHECK_TOL, atol=CHECK_TOL)):
                return f"the native merge failed its self-check against the reference ({dtype}, N={n})"
            for r in range(n):
                got_r = module.rescale_to_global(o[r], lse[r], lse)
                ref_r = rescale_to_global_reference(o[r], lse[r], lse)
                if got_r is None or got_r[0].dtype != ref_r[0].dtype or got_r[1].dtype != ref_r[1].dtype:
                    return f"the native rescale_to_global declined or changed dtypes ({dtype}, {lse_dtype})"
                if not (torch.equal(got_r[1], got[1]) and torch.equal(got_r[0] == 0, ref_r[0] == 0)
                        and torch.allclose(got_r[0].double(), ref_r[0].double(), rtol=tol, atol=tol)):
                    return f"the native rescale_to_global failed its self-check ({dtype}, N={n}, rank {r})"
    return None


# merge_attention runs natively on CPU once _merge_check passed in this process; ``MERGE.reason``
# says why not.
MERGE = SelfCheckedKernel(native.EXTENSION, _merge_check)


def _ready() -> bool:
    """The extension is loaded in this process (by the paged kernel or a cache write: a merge never
    starts a build, which can take a minute, inside a rank's step) and passed the self-check."""
    return MERGE.extension.module is not None and MERGE.enabled()


def merge_attention(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The native merge's ``(out, lse)``, or ``None`` where it does not run (not CPU, the extension
    not loaded in this process yet, off, or inputs it does not take): the caller then runs the
    reference."""
    if outs.device.type != "cpu" or not _ready():
        return None
    return MERGE.extension.module.merge_attention(outs, lses)


def rescale_to_global(out: torch.Tensor, lse: torch.Tensor,
                      lses_all: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The native ``rescale_to_global``'s ``(scaled, lse_global)``, or ``None`` where it does not run."""
    if out.device.type != "cpu" or not _ready():
        return None
    return MERGE.extension.module.rescale_to_global(out, lse, lses_all)
