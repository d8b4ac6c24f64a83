"""A short-convolution layer (LFM2) over a step's flattened tokens, with per-request conv state.

Canonical weights (:class:`ShortConvWeights`, one rank's share of ``C`` channels): the gates
``w_b, w_c`` and input ``w_x [C, H]`` (with optional biases), the depthwise ``conv_weight [C, K]``
(optional bias) and ``out_proj [H, C]`` with an optional bias that only one rank adds. For
``x [T, H]``::

    y = out_proj( (x w_cᵀ + b_c) ⊙ conv((x w_bᵀ + b_b) ⊙ (x w_xᵀ + b_x)) ) + b_out

with the causal conv of :func:`dcpgraph.ops.gated_delta.causal_conv1d_` (no activation). Every
channel is independent until ``out_proj``, so ranks with disjoint channels give partial outputs
that sum to the layer's (a row-parallel linear).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import gated_delta  # noqa: F401  (registers the ops)


@dataclass(frozen=True)
class ShortConvWeights:
    w_b: torch.Tensor
    w_c: torch.Tensor
    w_x: torch.Tensor
    bias_b: torch.Tensor | None
    bias_c: torch.Tensor | None
    bias_x: torch.Tensor | None
    conv_weight: torch.Tensor
    conv_bias: torch.Tensor | None
    out_proj: torch.Tensor
    out_bias: torch.Tensor | None  # None on every rank but the one that adds it


def short_conv(w: ShortConvWeights, hidden: torch.Tensor, conv_states: torch.Tensor, state_slots: torch.Tensor,
               cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
    """``hidden [T, H]`` → this rank's (partial) output ``[T, H]``; conv states updated in place."""
    return short_conv_with(w, hidden, lambda x: torch.ops.dcpgraph.causal_conv1d_(
        x, w.conv_weight, w.conv_bias, conv_states, state_slots, cu_seqlens_q, context_lens, "none"))


def short_conv_canonical(w: ShortConvWeights, hidden: torch.Tensor) -> torch.Tensor:
    """One request's tokens from a zero state with the canonical (stateless) conv: what a front
    end traces."""
    return short_conv_with(w, hidden, lambda x: torch.ops.dcpgraph.causal_conv1d(x, w.conv_weight, w.conv_bias,
                                                                                  "none"))


def short_conv_with(w: ShortConvWeights, hidden: torch.Tensor, conv) -> torch.Tensor:
    """The layer's formula (module docstring) with ``conv(x [T, C])`` supplied."""
    gated = F.linear(hidden, w.w_b, w.bias_b) * F.linear(hidden, w.w_x, w.bias_x)
    return F.linear(F.linear(hidden, w.w_c, w.bias_c) * conv(gated), w.out_proj, w.out_bias)
