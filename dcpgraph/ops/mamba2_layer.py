"""A whole Mamba-2 mixer over a step's flattened tokens, with explicit per-request state.

Canonical weights (:class:`Mamba2Weights`): ``in_proj`` split into the gate ``w_z [I, H]``, the
conv input ``w_xbc [I + 2GN, H]`` (channels ``[x | B | C]``) and ``w_dt [Hh, H]`` (optional
biases), the depthwise ``conv_weight [I + 2GN, K]`` (optional bias), per head ``a_log, d,
dt_bias [Hh]``, the gated norm's ``norm_weight [I]`` (or none) and ``out_proj [H, I]``, with
``I = Hh·P``. Falcon-H1's µP multipliers are explicit: ``in_multiplier`` scales the input and
``z_scale``/``xbc_scale``/``dt_scale`` the projection's parts. For hidden states ``h [T, H]``::

    z, xbc, dt = (h·m_in) w_zᵀ·m_z, (h·m_in) w_xbcᵀ·m_xbc, (h·m_in) w_dtᵀ·m_dt
    x, B, C = silu(conv(xbc))                                  (causal_conv1d_, SiLU)
    y = mamba2_scan_(x, dt, −exp(a_log), B, C, d, dt_bias)     (per head, B/C per group)
    g = norm(y, z)                                             (below)
    out = g out_projᵀ (+ out bias)

with ``norm`` one of: ``rms_g(y ⊙ silu(z)) · w`` (gate then norm, HF's Mamba-2 default),
``rms_g(y) · w ⊙ silu(z)`` (``norm_before_gate``), or ``y ⊙ silu(z)`` without a norm weight;
``rms_g`` normalises each of ``norm_groups`` contiguous groups of ``I/norm_groups`` channels, in
fp32.

TP split: a group of ``tp`` dividing both the heads ``Hh`` and the groups ``G`` splits the layer
by head groups — see :func:`mamba2_tp_rule` (applied to canonical weights by
:func:`dcpgraph.frontends.mamba2.tp_shard`, to a traced program by
:mod:`dcpgraph.passes.shard_recurrent_tp`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import gated_delta, mamba2  # noqa: F401  (register the conv and scan ops)


@dataclass(frozen=True)
class Mamba2Weights:
    """One Mamba-2 mixer's canonical weights (see the module docstring)."""

    heads: int
    head_dim: int
    groups: int
    state_size: int
    w_z: torch.Tensor
    w_xbc: torch.Tensor
    w_dt: torch.Tensor
    bias_z: torch.Tensor | None
    bias_xbc: torch.Tensor | None
    bias_dt: torch.Tensor | None
    conv_weight: torch.Tensor
    conv_bias: torch.Tensor | None
    a_log: torch.Tensor
    d: torch.Tensor
    dt_bias: torch.Tensor
    norm_weight: torch.Tensor | None
    norm_groups: int
    norm_eps: float
    norm_before_gate: bool
    out_proj: torch.Tensor
    out_bias: torch.Tensor | None
    dt_min: float
    dt_max: float
    scan_chunk: int
    in_multiplier: float = 1.0
    z_scale: torch.Tensor | float = 1.0
    xbc_scale: torch.Tensor | float = 1.0
    dt_scale: torch.Tensor | float = 1.0


def mamba2_tp_rule() -> dict[str, str]:
    """How a TP group of ``tp`` (dividing the heads ``Hh`` and the groups ``G``) splits the layer:
    parameter → what rank ``i`` takes. Ranks then hold ``Hh/tp`` heads and ``G/tp`` groups, the
    conv state ``[(I + 2GN)/tp, K−1]`` and SSM state ``[Hh/tp, P, N]``; their outputs are partial
    sums (one all-reduce). Where ``tp`` does not divide both, the layer is replicated."""
    return {
        "w_z, bias_z": "rows [i·I/tp, (i+1)·I/tp) (the rank's heads' channels)",
        "w_xbc, bias_xbc, conv_weight, conv_bias": "each of the x, B, C segments: its i-th 1/tp (x by heads, "
                                                   "B and C by groups)",
        "w_dt, bias_dt, a_log, d, dt_bias": "heads [i·Hh/tp, (i+1)·Hh/tp)",
        "norm_weight": "channels [i·I/tp, (i+1)·I/tp); norm_groups/tp groups per rank (needs tp | norm_groups)",
        "out_proj": "columns [i·I/tp, (i+1)·I/tp); out_bias added by rank 0 only",
    }


def gated_group_rms_norm(y: torch.Tensor, z: torch.Tensor, w: Mamba2Weights) -> torch.Tensor:
    """The mixer's ``norm(y, z)`` (module docstring) in fp32, ``y, z [T, I]``."""
    y32, gate = y.float(), F.silu(z.float())
    if w.norm_weight is None:
        return y32 * gate
    if not w.norm_before_gate:
        y32 = y32 * gate
    group_size = w.heads * w.head_dim // w.norm_groups  # the same on every TP rank: heads split by whole groups
    grouped = y32.reshape(*y32.shape[:-1], -1, group_size)
    normed = (grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + w.norm_eps)).flatten(-2)
    normed = normed * w.norm_weight.float()
    return normed * gate if w.norm_before_gate else normed


def mamba2_mixer(w: Mamba2Weights, hidden: torch.Tensor, conv_states: torch.Tensor, ssm_states: torch.Tensor,
                 state_slots: torch.Tensor, cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
    """``hidden [T, H]`` → the mixer's output ``[T, H]``; the step's rows' states updated in place."""
    rows = (state_slots, cu_seqlens_q, context_lens)
    return mamba2_mixer_with(
        w, hidden,
        lambda xbc: torch.ops.dcpgraph.causal_conv1d_(xbc, w.conv_weight, w.conv_bias, conv_states, *rows, "silu"),
        lambda x, dt, a, b, c: torch.ops.dcpgraph.mamba2_scan_(x, dt, a, b, c, w.d, w.dt_bias, ssm_states, *rows,
                                                               w.dt_min, w.dt_max, w.scan_chunk),
    )


def mamba2_mixer_canonical(w: Mamba2Weights, hidden: torch.Tensor) -> torch.Tensor:
    """The mixer over one request's tokens from a zero state with the canonical ops: what a front
    end traces."""
    return mamba2_mixer_with(
        w, hidden,
        lambda xbc: torch.ops.dcpgraph.causal_conv1d(xbc, w.conv_weight, w.conv_bias, "silu"),
        lambda x, dt, a, b, c: torch.ops.dcpgraph.mamba2_scan(x, dt, a, b, c, w.d, w.dt_bias, w.dt_min, w.dt_max,
                                                              w.scan_chunk),
    )


def mamba2_mixer_with(w: Mamba2Weights, hidden: torch.Tensor, conv, scan) -> torch.Tensor:
    """The mixer's formula (module docstring) with ``conv(xbc [T, I+2GN])`` and
    ``scan(x, dt, A, B, C)`` supplied: stateful or canonical. Head and group counts stay out of
    traced shapes (``-1``; the norm reshapes by its group size, which a TP split keeps), so the
    only literals a TP split changes are the ``[x | B | C]`` section sizes."""
    tokens, inner, gn = hidden.shape[0], w.heads * w.head_dim, w.groups * w.state_size
    h = _scaled(hidden, w.in_multiplier)
    z = _scaled(F.linear(h, w.w_z, w.bias_z), w.z_scale)
    xbc = conv(_scaled(F.linear(h, w.w_xbc, w.bias_xbc), w.xbc_scale))
    dt = _scaled(F.linear(h, w.w_dt, w.bias_dt), w.dt_scale)
    x, b, c = xbc.split([inner, gn, gn], dim=-1)
    x = x.reshape(tokens, -1, w.head_dim)
    b, c = b.reshape(tokens, -1, w.state_size), c.reshape(tokens, -1, w.state_size)
    y = scan(x, dt, -torch.exp(w.a_log.float()), b, c)
    g = gated_group_rms_norm(y.reshape(tokens, -1), z, w).to(hidden.dtype)
    return F.linear(g, w.out_proj, w.out_bias)


def _scaled(t: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """``t · scale`` (a number or per-channel tensor); ``t`` itself for the number 1."""
    if isinstance(scale, (int, float)) and scale == 1.0:
        return t
    return t * scale
