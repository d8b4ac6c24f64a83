"""``merge_attention`` → ``npu_attention_update`` or the aten merge; ``rescale_to_global`` → aten.

The aten forms are :mod:`dcpgraph.ops.merge`'s reference functions themselves, traced (with
``amax``/``isnan`` expressed as ops GE converts), so the edge rules are defined in one place.
"""

from __future__ import annotations

import torch

from ...ops.merge import (
    NEG_INF,
    merge_attention_reference,
    rescale_to_global_reference,
    sanitize_lse,
)
from .ascend import attention_update_op
from .rules import Site, register

dcp_ops = torch.ops.dcpgraph

UPDATE_MAX_PARTIALS = 16
UPDATE_HEAD_DIM = (8, 512, 8)  # min, max, multiple
UPDATE_OUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# An empty partial's lse as handed to npu_attention_update: finite, so max/exp never see
# −inf − (−inf), and small enough that exp(lse − max) is exactly 0 next to any real lse.
EMPTY_LSE = -1e30


def attention_update_limits(site: Site) -> str | None:
    """None when ``npu_attention_update`` can do this merge, else why not."""
    outs, lses = site.args
    n, dv = int(outs.shape[0]), int(outs.shape[-1])
    low, high, multiple = UPDATE_HEAD_DIM
    if n > UPDATE_MAX_PARTIALS:
        return f"{n} partials > {UPDATE_MAX_PARTIALS}"
    if not (low <= dv <= high and dv % multiple == 0):
        return f"value head dim {dv} outside [{low}, {high}] or not a multiple of {multiple}"
    if outs.dtype not in UPDATE_OUT_DTYPES:
        return f"output dtype {outs.dtype}"
    if lses.dtype == torch.float64:
        return "fp64 lse (the op's lse is fp32)"
    return None


def _update_params(site: Site) -> dict:
    return {"want_lse": site.used(1), "lse_dtype": site.output(1).dtype}


@register(dcp_ops.merge_attention.default, "merge_attention->npu_attention_update",
          checker=attention_update_limits, params=_update_params, uses="npu")
def merge_with_attention_update(outs: torch.Tensor, lses: torch.Tensor, *, want_lse: bool,
                                lse_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``npu.npu_attention_update(lse_list, out_list, update_type)`` with dcpgraph's edge rules.

    The op merges ``sp`` partials given as lists: lses ``[M]`` fp32 and outputs ``[M, Dv]``
    (fp32/fp16/bf16), ``sp`` ≤ 16, ``Dv`` in [8, 512] and a multiple of 8 (dcp ≤ 16 on the a2a
    path; the final two-way context/new merge always fits). It computes the merged lse only for
    ``update_type=1``, used here only if something reads it; it has no empty-partial handling.
    Around it: NaN/+inf lse counts as empty (:func:`~dcpgraph.ops.merge.sanitize_lse`), an empty
    partial's output (maybe NaN) is zeroed and its lse set to ``EMPTY_LSE`` so the op never
    computes ``−inf − (−inf)``, and rows where every partial is empty give ``(0, −inf)``.
    The op's numerics are unverified without Ascend hardware.
    """
    lse32 = sanitize_lse(lses)  # fp32: the limits exclude fp64
    valid = lse32 > NEG_INF  # [N, T, H]
    lse_list = [lse.flatten() for lse in torch.where(valid, lse32, EMPTY_LSE).unbind(0)]
    out_list = [out.flatten(0, -2) for out in torch.where(valid.unsqueeze(-1), outs, 0.0).unbind(0)]
    merged_out, merged_lse = attention_update_op()(lse_list, out_list, 1 if want_lse else 0)
    any_valid = valid.any(0)  # [T, H]
    out = torch.where(any_valid.unsqueeze(-1), merged_out.reshape_as(outs[0]), 0.0)
    if not want_lse:
        return out, None
    lse = torch.where(any_valid, merged_lse.reshape_as(lses[0]), NEG_INF).to(lse_dtype)
    return out, lse


register(dcp_ops.merge_attention.default, "merge_attention->aten")(merge_attention_reference)
register(dcp_ops.rescale_to_global.default, "rescale_to_global->aten")(rescale_to_global_reference)
