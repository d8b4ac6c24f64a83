"""DeepSeek-V4's compressed attention for GE: what lowers, and why the rest does not.

``compressed_merge_sinks`` → aten. The op merges the DCP group's partials ``outs [N, H, T, D]``,
``lses [N, H, T]`` by log-sum-exp and joins the per-head sink ``s_h`` once::

    lse = logsumexp_i lse_i                     (max + log Σ exp(lse_i − max); −inf when all are)
    o   = Σ_i w_i·o_i,   w_i = exp(lse_i − lse), 0 where lse = −inf (every partial empty)
    out = o · exp(lse − logaddexp(lse, s_h)) = o · sigmoid(lse − s_h),   0 where lse = −inf

in ``acc = promote(dtype, fp32)``, the result cast back to ``outs``' dtype and shaped
``[1, H, T, D]``. The op zeroes ``w_i`` with ``nan_to_num``, which is NaN exactly where every
partial is empty (its lses are −inf or finite); the rule zeroes it there by ``where``, because
torchair 2.13's ``nan_to_num`` converter fails on the default ``posinf=None``. All shapes are the
inputs' (static), and every op converts (``ArgMaxWithValue``, ``Exp``, ``Log``, ``ReduceSum``,
``SelectV2``, ``Sigmoid``; not ``logaddexp``, whose converter raises NotImplementedError), checked by
``tests/torchair_tier/test_torchair_v4.py``.

The other V4 ops deliberately have **no rule** (:data:`NO_GE_FORM`): their kernels are
per-request loops whose trip counts and slice lengths come from step metadata read on the host
(``cu_seqlens_q.tolist()``, ``context_lens.tolist()``, the number of visible entries
``(c + n) // m``), which neither GE (a static graph) nor an aclgraph capture (``npugraph_ex``,
which replays device work without the host reads) can express as written. A program holding
any of them is compiled eagerly by the torchair backend, which says so
(:func:`dcpgraph.backends.npu.decide.ge_decision`), instead of failing inside GE. What a static
form would take is written per op below; none is built.
"""

from __future__ import annotations

import torch

from ...ops.merge import NEG_INF
from .rules import register

dcp_ops = torch.ops.dcpgraph


@register(dcp_ops.compressed_merge_sinks.default, "compressed_merge_sinks->aten")
def compressed_merge_sinks_as_aten(outs: torch.Tensor, lses: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    acc = torch.promote_types(outs.dtype, torch.float32)
    lse_i = lses.to(acc)  # [N, H, T]
    peak = torch.max(lse_i, 0)[0]  # [H, T]
    peak = torch.where(peak == NEG_INF, 0.0, peak)  # all empty: exp(−inf − 0) = 0, log 0 = −inf
    lse = peak + torch.log(torch.exp(lse_i - peak).sum(0))
    weight = torch.where(lse == NEG_INF, 0.0, torch.exp(lse_i - lse))  # the op's NaN → 0 (all empty)
    merged = (outs.to(acc) * weight.unsqueeze(-1)).sum(0)  # [H, T, D]
    share = torch.sigmoid(lse - sinks.to(acc).unsqueeze(-1))
    share = torch.where(lse == NEG_INF, 0.0, share)
    return (merged * share.unsqueeze(-1)).unsqueeze(0).to(outs.dtype)


# The V4 ops with no GE form, and why (what a static-shape form would need).
NO_GE_FORM: dict[str, str] = {
    "compress_windows_": (
        "per-request open windows: each request's pooled entries depend on its context length "
        "(c mod m rows held) and are placed at rows computed on the host; a static form would "
        "gather [T, 2m] slots per token from the held rows and the step's rows"),
    "compressed_topk_": (
        "writes the closing rows' indexer keys, then scores each request's (c + n) // m entries, "
        "a host-read count; LightningIndexer's contract fits only bf16/fp16 keys with m dividing "
        "the block size (a PA_BSND cache of B/m rows per block)"),
    "compressed_topk_dcp_": (
        "as compressed_topk_, over the entries this DCP rank owns (a host-read local count, then "
        "local → global entry indices)"),
    "compressed_attention_": (
        "writes the raw row and the entries, then one softmax per request over a host-sized raw "
        "window and (c + n) // m entries plus the sink; no FusedInferAttentionScore form reads "
        "two paged caches with a per-query entry bound"),
    "compressed_attention_dcp_": (
        "as compressed_attention_, over the rows and entries this DCP rank owns, returning "
        "(out, lse) without the sink"),
}
