"""Exact N-way merge of partial attention results by their log-sum-exp.

For partials ``(o_i, lse_i)`` over disjoint key sets::

    lse = logsumexp_i(lse_i)          o = Σ_i exp(lse_i − lse) · o_i

The merge is associative and commutative, so any tree of merges gives the dense result.
Edge rules (each one a bug some system shipped): a shard with no keys has ``lse = −inf`` and any
output, NaN included, and contributes nothing; NaN or +inf LSE counts as −inf; if every shard is
empty the result is ``(0, −inf)``, never NaN; accumulation is fp32 (fp64 for fp64 inputs); the
output keeps the input dtype; the LSE is natural-log, fp32 or wider.
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: fp32, or fp64 when the inputs are fp64."""
    return torch.promote_types(dtype, torch.float32)


def sanitize_lse(lse: torch.Tensor) -> torch.Tensor:
    """Copy of ``lse`` (at least fp32) with NaN and +inf mapped to −inf (an empty shard)."""
    return torch.nan_to_num(lse.to(acc_dtype(lse.dtype)), nan=NEG_INF, posinf=NEG_INF, neginf=NEG_INF)


def merge_weights(lses: torch.Tensor, dim: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights ``exp(lse_i − lse)`` along ``dim`` and the merged ``lse`` (fp32).

    Rows where every entry is −inf get weights 0 and ``lse = −inf``. With ``peak`` the row's
    largest LSE (0 for an empty row), ``total = Σ exp(lse_i − peak)`` is 0 for an empty row and
    at least 1 otherwise (the peak's own term is exactly 1), so ``scaled / max(total, 1)`` and
    ``peak + log(total)`` need no masks: they give 0 and −inf for empty rows by themselves.
    """
    lses = sanitize_lse(lses)
    # Every value given explicitly (a sanitized max is never NaN or +inf): torchair's NanToNum
    # converter takes numbers only, and the aten merge is what Ascend runs past its own op's limits.
    peak = torch.nan_to_num(lses.amax(dim, keepdim=True), nan=0.0, posinf=0.0, neginf=0.0)
    scaled = torch.sub(lses, peak).exp_()
    total = scaled.sum(dim, keepdim=True)
    weights = scaled.div_(total.clamp(min=1.0))
    lse = peak.add_(total.log_())
    return weights, lse.squeeze(dim)


def weighted_sum(outs: torch.Tensor, weights: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """``Σ w_i·o_i`` in fp32 where a zero weight contributes exactly nothing (NaN cannot leak)."""
    acc = torch.promote_types(weights.dtype, outs.dtype)
    w = weights.unsqueeze(-1)
    return torch.where(w > 0, w * outs.to(acc), 0.0).sum(dim)


def merge_attention_reference(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference kernel of ``dcpgraph::merge_attention``: outs ``[N, ..., D]``, lses ``[N, ...]``."""
    if outs.dim() != lses.dim() + 1 or outs.shape[:-1] != lses.shape:
        raise ValueError(
            f"merge_attention: outs {tuple(outs.shape)} must be lses {tuple(lses.shape)} plus a "
            "trailing head-dim axis"
        )
    weights, lse = merge_weights(lses, 0)
    return weighted_sum(outs, weights, 0).to(outs.dtype), lse


def rescale_to_global_reference(
    out: torch.Tensor, lse: torch.Tensor, lses_all: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The AG+RS merge's local step: scale this rank's partial to its share of the global result.

    ``lses_all`` ``[N, ...]`` are every rank's LSEs for the same rows (``lse`` is this rank's
    entry). Returns ``(exp(lse − lse_g)·out`` in fp32, zero where the weight is 0``, lse_g)``, so
    summing the first result over ranks (a reduce-scatter) gives the merged output.
    """
    _, lse_global = merge_weights(lses_all, 0)
    own = sanitize_lse(lse)
    weight = torch.where(lse_global == NEG_INF, 0.0, torch.exp(own - lse_global))
    acc = torch.promote_types(weight.dtype, out.dtype)
    scaled = torch.where(weight.unsqueeze(-1) > 0, weight.unsqueeze(-1) * out.to(acc), 0.0)
    return scaled, lse_global
