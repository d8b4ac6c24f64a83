"""A whole Kimi delta attention (KDA) layer over a step's flattened tokens, with explicit state.

Canonical weights (:class:`KimiDeltaWeights`, one rank's share, ``H`` heads of ``D`` channels):
projections ``w_q, w_k, w_v [H·D, hidden]``, the depthwise conv ``conv_weight [3·H·D, K]`` over
``[q | k | v]``, the forget gate (``forget_up [H·D, ·]`` after an optional low-rank
``forget_down [r, hidden]``, ``dt_bias [H·D]``, ``a_log`` with ``H`` entries), ``w_b [H, hidden]``,
the output gate (``gate_up [H·D, ·]`` after an optional ``gate_down``), the gated norm's
``norm_weight [D]`` and ``o_proj [hidden, H·D]``. For hidden states ``x [T, hidden]``::

    q, k, v = conv(x w_qᵀ | x w_kᵀ | x w_vᵀ)                        (causal_conv1d_, SiLU)
    f = up(down(x)) + dt_bias                                       (fp32, per head and channel)
    g = −exp(a_log_h) · softplus(f)                 (Kimi-Linear; "softplus")
    g = bound · σ(exp(a_log_h) · f)                 (Bailing's safe gate; "bounded", bound < 0)
    β = σ(x w_bᵀ)
    o = kimi_delta_rule_(q, k, v, g, β)                             (per head)
    y = (rms_norm(o) · norm_weight · σ(gate_up(gate_down(x)))) o_projᵀ   (norm over D in fp32)

Every output row of ``o_proj`` sums over heads, so TP ranks holding disjoint heads produce
partial ``y`` that sum to the layer's output (one all-reduce, as a row-parallel linear).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import gated_delta, kimi_delta  # noqa: F401  (register the ops)

DEFAULT_SCAN_CHUNK = 64
FORGET_GATES = ("softplus", "bounded")


@dataclass(frozen=True)
class KimiDeltaWeights:
    """One rank's canonical KDA weights (module docstring); ``heads`` is the rank's count.
    ``forget_gate`` is one of :data:`FORGET_GATES` (``bounded`` reads ``forget_bound``);
    ``gate_in_model_dtype``: the decay is rounded to the model's dtype before the rule (Bailing)."""

    heads: int
    head_dim: int
    w_q: torch.Tensor
    w_k: torch.Tensor
    w_v: torch.Tensor
    conv_weight: torch.Tensor
    conv_bias: torch.Tensor | None
    forget_down: torch.Tensor | None
    forget_up: torch.Tensor
    dt_bias: torch.Tensor
    a_log: torch.Tensor
    forget_gate: str
    forget_bound: float | None
    gate_in_model_dtype: bool
    w_b: torch.Tensor
    gate_down: torch.Tensor | None
    gate_up: torch.Tensor
    norm_weight: torch.Tensor
    norm_eps: float
    o_proj: torch.Tensor

    def __post_init__(self) -> None:
        if self.forget_gate not in FORGET_GATES:
            raise ValueError(f"KDA forget_gate must be one of {FORGET_GATES}, got {self.forget_gate!r}")
        if self.forget_gate == "bounded" and self.forget_bound is None:
            raise ValueError("a bounded KDA forget gate needs forget_bound")


def sigmoid_gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight · x/rms(x) · σ(gate)``, all in fp32 (the weight too), over the last dim, in
    ``x``'s dtype."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * normed * torch.sigmoid(gate.float())).to(x.dtype)


def _low_rank(hidden: torch.Tensor, down: torch.Tensor | None, up: torch.Tensor) -> torch.Tensor:
    return F.linear(hidden if down is None else F.linear(hidden, down), up)


def forget_log_decay(w: KimiDeltaWeights, hidden: torch.Tensor) -> torch.Tensor:
    """``g [T, H, D]``: the log-decay per head and key channel (module docstring), fp32, or the
    model's dtype where ``gate_in_model_dtype``."""
    tokens = hidden.shape[0]
    f = (_low_rank(hidden, w.forget_down, w.forget_up).float() + w.dt_bias.float()).reshape(tokens, -1, w.head_dim)
    rate = w.a_log.float().exp().reshape(-1, 1)  # [H, 1]
    if w.forget_gate == "softplus":
        g = -rate * F.softplus(f)
    else:
        g = w.forget_bound * torch.sigmoid(rate * f)
    return g.to(hidden.dtype) if w.gate_in_model_dtype else g


def kimi_delta_attention(w: KimiDeltaWeights, hidden: torch.Tensor, conv_states: torch.Tensor,
                         recurrent_states: torch.Tensor, state_slots: torch.Tensor, cu_seqlens_q: torch.Tensor,
                         context_lens: torch.Tensor, scan_chunk: int = DEFAULT_SCAN_CHUNK) -> torch.Tensor:
    """``hidden [T, hidden]`` → this rank's (partial) layer output; the states of the step's rows
    are updated in place (see :mod:`dcpgraph.ops.kimi_delta`)."""
    rows = (state_slots, cu_seqlens_q, context_lens)
    return kimi_delta_attention_with(
        w, hidden,
        lambda x: torch.ops.dcpgraph.causal_conv1d_(x, w.conv_weight, w.conv_bias, conv_states, *rows, "silu"),
        lambda q, k, v, g, beta: torch.ops.dcpgraph.kimi_delta_rule_(q, k, v, g, beta, recurrent_states, *rows,
                                                                     scan_chunk),
    )


def kimi_delta_attention_canonical(w: KimiDeltaWeights, hidden: torch.Tensor,
                                   scan_chunk: int = DEFAULT_SCAN_CHUNK) -> torch.Tensor:
    """The layer over one request's tokens from a zero state, with the canonical (stateless) ops:
    what a front end traces."""
    return kimi_delta_attention_with(
        w, hidden,
        lambda x: torch.ops.dcpgraph.causal_conv1d(x, w.conv_weight, w.conv_bias, "silu"),
        lambda q, k, v, g, beta: torch.ops.dcpgraph.kimi_delta_rule(q, k, v, g, beta, scan_chunk),
    )


def kimi_delta_attention_with(w: KimiDeltaWeights, hidden: torch.Tensor, conv, rule) -> torch.Tensor:
    """The layer's formula (module docstring) with ``conv(mixed [T, 3·H·D])`` and
    ``rule(q, k, v, g, beta)`` supplied: stateful or canonical. Head counts are ``-1`` in every
    reshape, so in a traced layer the only head-dependent sizes are the ``[q | k | v]`` split's
    (what ``shard_recurrent_tp`` rescales)."""
    tokens = hidden.shape[0]
    mixed = conv(torch.cat([F.linear(hidden, w.w_q), F.linear(hidden, w.w_k), F.linear(hidden, w.w_v)], dim=-1))
    width = w.heads * w.head_dim
    q, k, v = (t.reshape(tokens, -1, w.head_dim) for t in mixed.split([width, width, width], dim=-1))
    beta = torch.sigmoid(F.linear(hidden, w.w_b))
    o = rule(q, k, v, forget_log_decay(w, hidden), beta)
    gate = _low_rank(hidden, w.gate_down, w.gate_up).reshape(tokens, -1, w.head_dim)
    o = sigmoid_gated_rms_norm(o, gate, w.norm_weight, w.norm_eps)
    return F.linear(o.reshape(tokens, -1), w.o_proj)
