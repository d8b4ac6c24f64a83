"""A whole gated delta net layer over a step's flattened tokens, with explicit per-request state.

Canonical weights (:class:`GatedDeltaNetWeights`, one rank's share): separate projections
``w_q, w_k [Hk·Dk, H]``, ``w_v, w_z [Hv·Dv, H]``, ``w_b, w_a [Hv, H]``, the depthwise conv
``conv_weight [C, K]`` over channels ``[q | k | v]``, per value head ``a_log, dt_bias [Hv]``, the
gated norm's ``norm_weight [Dv]``, ``out_proj [H, Hv·Dv]`` and ``beta_scale`` (2 where OLMo-Hybrid's
``allow_neg_eigval`` lets ``β`` reach 2, else 1). For hidden states ``x [T, H]``::

    q, k, v = conv(x w_qᵀ | x w_kᵀ | x w_vᵀ)                      (causal_conv1d_, SiLU)
    g = −exp(a_log) · softplus(x w_aᵀ + dt_bias),  β = beta_scale · σ(x w_bᵀ)
    o = gated_delta_rule_(q, k, v, g, β)                          (per value head)
    y = (rms_norm(o) · norm_weight · silu(x w_zᵀ)) out_projᵀ      (norm over Dv, per head)

Every output row of ``out_proj`` sums over value heads, so TP ranks holding disjoint head groups
produce partial ``y`` that sum to the layer's output (one all-reduce, as a row-parallel linear).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import gated_delta  # noqa: F401  (registers the ops)

DEFAULT_SCAN_CHUNK = 64


@dataclass(frozen=True)
class GatedDeltaNetWeights:
    """One rank's canonical GDN weights; ``key_heads``/``value_heads`` are the rank's counts."""

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    w_q: torch.Tensor
    w_k: torch.Tensor
    w_v: torch.Tensor
    w_z: torch.Tensor
    w_b: torch.Tensor
    w_a: torch.Tensor
    conv_weight: torch.Tensor
    conv_bias: torch.Tensor | None
    a_log: torch.Tensor
    dt_bias: torch.Tensor
    norm_weight: torch.Tensor
    norm_eps: float
    out_proj: torch.Tensor
    beta_scale: float = 1.0


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight · x/rms(x)`` (normalised in fp32, cast back before the weight) times ``silu(gate)``
    in fp32, over the last dim, in ``x``'s dtype."""
    dtype = x.dtype
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return ((weight * normed.to(dtype)) * F.silu(gate.float())).to(dtype)


def gated_delta_net(w: GatedDeltaNetWeights, hidden: torch.Tensor, conv_states: torch.Tensor,
                    recurrent_states: torch.Tensor, state_slots: torch.Tensor, cu_seqlens_q: torch.Tensor,
                    context_lens: torch.Tensor, scan_chunk: int = DEFAULT_SCAN_CHUNK) -> torch.Tensor:
    """``hidden [T, H]`` → this rank's (partial) layer output ``[T, H]``; the states of the
    step's rows are updated in place (see :mod:`dcpgraph.ops.gated_delta`)."""
    rows = (state_slots, cu_seqlens_q, context_lens)
    return gated_delta_net_with(
        w, hidden,
        lambda x: torch.ops.dcpgraph.causal_conv1d_(x, w.conv_weight, w.conv_bias, conv_states, *rows, "silu"),
        lambda q, k, v, g, beta: torch.ops.dcpgraph.gated_delta_rule_(q, k, v, g, beta, recurrent_states, *rows,
                                                                      scan_chunk),
    )


def gated_delta_net_canonical(w: GatedDeltaNetWeights, hidden: torch.Tensor,
                              scan_chunk: int = DEFAULT_SCAN_CHUNK) -> torch.Tensor:
    """The layer over one request's tokens from a zero state, with the canonical (stateless) ops:
    what a front end traces."""
    return gated_delta_net_with(
        w, hidden,
        lambda x: torch.ops.dcpgraph.causal_conv1d(x, w.conv_weight, w.conv_bias, "silu"),
        lambda q, k, v, g, beta: torch.ops.dcpgraph.gated_delta_rule(q, k, v, g, beta, scan_chunk),
    )


def gated_delta_net_with(w: GatedDeltaNetWeights, hidden: torch.Tensor, conv, rule) -> torch.Tensor:
    """The layer's formula (module docstring) with ``conv(mixed [T, C])`` and
    ``rule(q, k, v, g, beta)`` supplied: stateful or canonical. Head counts are ``-1`` in every
    reshape, so in a traced layer the only sizes that depend on the rank's heads are the
    ``[q | k | v]`` split's (what ``shard_recurrent_tp`` rescales)."""
    tokens = hidden.shape[0]
    mixed = conv(torch.cat([F.linear(hidden, w.w_q), F.linear(hidden, w.w_k), F.linear(hidden, w.w_v)], dim=-1))
    qk = w.key_heads * w.key_dim
    q, k, v = mixed.split([qk, qk, w.value_heads * w.value_dim], dim=-1)
    q = q.reshape(tokens, -1, w.key_dim)
    k = k.reshape(tokens, -1, w.key_dim)
    v = v.reshape(tokens, -1, w.value_dim)
    beta = torch.sigmoid(F.linear(hidden, w.w_b))
    if w.beta_scale != 1.0:
        beta = beta * w.beta_scale
    g = -w.a_log.float().exp() * F.softplus(F.linear(hidden, w.w_a).float() + w.dt_bias)
    o = rule(q, k, v, g, beta)
    z = F.linear(hidden, w.w_z).reshape(tokens, -1, w.value_dim)
    o = gated_rms_norm(o, z, w.norm_weight, w.norm_eps)
    return F.linear(o.reshape(tokens, -1), w.out_proj)
