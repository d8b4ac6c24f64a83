"""A whole lightning-attention layer (MiniMax) over a step's flattened tokens, with per-request state.

Canonical weights (:class:`LightningAttentionWeights`, one rank's share of ``H`` heads of ``D``):
the fused projection ``w_qkv [H·3D, hidden]`` laid out per head ``[q_h | k_h | v_h]``, the decay
rate ``slope [H]``, the output norm's ``norm_weight [H·D]``, the gate ``w_gate [H·D, hidden]`` and
``out_proj [hidden, H·D]``. For hidden states ``x [T, hidden]``::

    q, k, v = silu(x w_qkvᵀ) split per head                          (each [T, H, D])
    o = lightning_attention_(q, k, v, slope)                          ([T, H·D])
    y = (σ(x w_gateᵀ) ⊙ rms_norm(o) · norm_weight) out_projᵀ          (norm over all H·D channels)

The norm spans every head, so TP ranks holding disjoint heads compute its mean of squares as the
average of their local means (one all-reduce of ``[T, 1]``, see ``shard_recurrent_tp``); every
output row of ``out_proj`` then sums over heads: partial ``y`` per rank (a row-parallel linear).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import lightning_attention  # noqa: F401  (registers the ops)


@dataclass(frozen=True)
class LightningAttentionWeights:
    """One rank's canonical lightning-attention weights; ``head_dim`` is D."""

    head_dim: int
    block_size: int
    w_qkv: torch.Tensor
    slope: torch.Tensor
    norm_weight: torch.Tensor
    norm_eps: float
    w_gate: torch.Tensor
    out_proj: torch.Tensor


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight · x/√(mean(x²) + eps)`` over the last dim, normalised in fp32 and cast back to
    ``x``'s dtype before the weight (HF's ``MiniMaxRMSNorm``)."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def lightning_attention_layer(w: LightningAttentionWeights, hidden: torch.Tensor, states: torch.Tensor,
                              state_slots: torch.Tensor, cu_seqlens_q: torch.Tensor,
                              context_lens: torch.Tensor) -> torch.Tensor:
    """``hidden [T, hidden]`` → this rank's (partial) output; the states of the step's rows are
    updated in place. With a head split the norm's mean must be averaged over ranks first: this
    single-rank form is for ``w`` holding every head."""
    return lightning_attention_layer_with(w, hidden, lambda q, k, v: torch.ops.dcpgraph.lightning_attention_(
        q, k, v, w.slope.reshape(-1), states, state_slots, cu_seqlens_q, context_lens, w.block_size))


def lightning_attention_canonical(w: LightningAttentionWeights, hidden: torch.Tensor) -> torch.Tensor:
    """One request's tokens from a zero state with the canonical (stateless) op: what a front end traces."""
    return lightning_attention_layer_with(w, hidden, lambda q, k, v: torch.ops.dcpgraph.lightning_attention(
        q, k, v, w.slope.reshape(-1), w.block_size))


def lightning_attention_layer_with(w: LightningAttentionWeights, hidden: torch.Tensor, attend) -> torch.Tensor:
    """The layer's formula (module docstring) with ``attend(q, k, v)`` supplied. Head counts are
    ``-1`` in every reshape and the q/k/v split is by ``D``, so a traced layer holds no literal
    that depends on the rank's heads."""
    tokens = hidden.shape[0]
    qkv = F.silu(F.linear(hidden, w.w_qkv)).reshape(tokens, -1, 3 * w.head_dim)
    q, k, v = qkv.split(w.head_dim, dim=-1)
    o = attend(q, k, v).reshape(tokens, -1)
    gated = torch.sigmoid(F.linear(hidden, w.w_gate)) * rms_norm(o, w.norm_weight, w.norm_eps)
    return F.linear(gated, w.out_proj)
