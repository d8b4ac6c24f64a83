"""Plain-torch references for the attention ops, independent of :mod:`dcpgraph.ops`.

Everything here is written with ordinary torch ops in float64 and plain Python loops over ranks,
so a test can compare the kernels under test (``torch.ops.dcpgraph.*``) with something that shares
none of their code paths:

- :func:`dense_attention`: ``softmax(scale·q·kᵀ)·v`` and ``logsumexp`` of the scores, GQA by
  ``repeat_interleave``, optionally causal by global position, with an optional sliding window,
  logit soft-cap and per-head sink logits (written as the models write them: ``c·tanh(s/c)``, a
  position mask, an extra softmax column);
- :func:`shard_tokens`: a sequence's tokens split into each DCP rank's contiguous local stream
  (:mod:`dcpgraph.layout`'s ``owner``/``local_index``);
- :func:`merge_by_hand`: the exact LSE merge as a running pair folded over ranks;
- :func:`sharded_attention_by_hand`: shard, attend per rank, merge, all by hand (the "JAX-style"
  reference of docs/architecture.md, Testing strategy).

Shapes are token-major as in the kernels: ``q [T, Hq, D]``, ``k [S, Hkv, D]``, ``v [S, Hkv, Dv]``,
``out [T, Hq, Dv]``, ``lse [T, Hq]`` (natural log). Results are float64.
"""

from __future__ import annotations

import math

import torch

from .. import layout

NEG_INF = float("-inf")


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    *,
    q_positions: torch.Tensor | None = None,
    k_positions: torch.Tensor | None = None,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense attention in float64 → ``(out [T, Hq, Dv], lse [T, Hq])``.

    With ``q_positions`` (global position of each query) the attention is causal by position:
    query ``i`` sees key ``j`` iff ``k_positions[j] <= q_positions[i]`` (``k_positions`` defaults
    to ``arange(S)``), and with ``window > 0`` also ``k_positions[j] > q_positions[i] − window``.
    ``softcap > 0`` replaces each scaled score by ``softcap·tanh(score/softcap)``. ``sinks [Hq]``
    appends one logit column per head to the softmax (GPT-OSS): it takes probability mass but
    carries no value; the returned ``lse`` then includes it. A query that sees no key (and has no
    sink) gets ``out = 0``, ``lse = −inf``.
    """
    hq, hkv = q.shape[1], k.shape[1]
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    group = hq // hkv
    qd = q.double().transpose(0, 1)  # [Hq, T, D]
    kd = k.double().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, S, D]
    vd = v.double().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, S, Dv]
    scores = scale * qd @ kd.transpose(1, 2)  # [Hq, T, S]
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    if q_positions is not None:
        kpos = torch.arange(k.shape[0]) if k_positions is None else k_positions
        visible = kpos.view(1, -1) <= q_positions.view(-1, 1)
        if window:
            visible &= kpos.view(1, -1) > q_positions.view(-1, 1) - window
        scores = scores.masked_fill(~visible, NEG_INF)
    if sinks is not None:
        sink_column = sinks.double().view(-1, 1, 1).expand(-1, scores.shape[1], 1)
        scores = torch.cat([scores, sink_column], dim=-1)
        vd = torch.cat([vd, vd.new_zeros(vd.shape[0], 1, vd.shape[2])], dim=1)
    lse = torch.logsumexp(scores, dim=-1)  # [Hq, T]
    safe = torch.where(torch.isinf(lse), 0.0, lse)
    probs = torch.exp(scores - safe.unsqueeze(-1))
    out = probs @ vd  # [Hq, T, Dv]
    return out.transpose(0, 1).contiguous(), lse.transpose(0, 1).contiguous()


def shard_tokens(x: torch.Tensor, dcp: int, interleave: int = 1) -> list[torch.Tensor]:
    """Rank ``r``'s local stream of a sequence ``x [L, ...]``: its tokens in local-index order.

    Token ``t`` goes to rank ``owner(t)`` at position ``local_index(t)``; the streams are dense
    (rank ``r``'s stream has ``local_len(L, r)`` tokens).
    """
    length = x.shape[0]
    t = torch.arange(length)
    owners = layout.owner(t, dcp, interleave)
    local = layout.local_index(t, dcp, interleave)
    streams = []
    for r in range(dcp):
        mine = owners == r
        n = int(mine.sum())
        stream = x.new_zeros((n, *x.shape[1:]))
        stream[local[mine]] = x[mine]
        streams.append(stream)
    return streams


def merge_by_hand(
    outs: list[torch.Tensor], lses: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold partials ``(o_r, lse_r)`` into one, rank by rank, in float64.

    Uses the textbook rules only: a partial whose LSE is not finite-or-−inf (NaN, +inf) or is −inf
    contributes nothing; a row no partial covers stays ``(0, −inf)``.
    """
    out = torch.zeros_like(outs[0], dtype=torch.float64)
    lse = torch.full_like(lses[0], NEG_INF, dtype=torch.float64)
    for o_r, l_r in zip(outs, lses):
        l_r = l_r.double()
        l_r = torch.where(torch.isnan(l_r) | (l_r == math.inf), NEG_INF, l_r)
        new = torch.logaddexp(lse, l_r)
        live = new > NEG_INF
        new_safe = torch.where(live, new, 0.0)
        w_old = torch.where(live & (lse > NEG_INF), torch.exp(lse - new_safe), 0.0)
        w_new = torch.where(live & (l_r > NEG_INF), torch.exp(l_r - new_safe), 0.0)
        o_r = torch.where((w_new > 0).unsqueeze(-1), o_r.double(), 0.0)
        out = w_old.unsqueeze(-1) * out + w_new.unsqueeze(-1) * o_r
        lse = new
    return out, lse


def sharded_attention_by_hand(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    dcp: int,
    interleave: int = 1,
    *,
    q_positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Shard ``k``/``v`` over ``dcp`` ranks, attend per rank densely, merge by hand (float64).

    Equals :func:`dense_attention` up to rounding; useful as a reference for DCP passes.
    """
    positions = torch.arange(k.shape[0])
    k_shards = shard_tokens(k, dcp, interleave)
    v_shards = shard_tokens(v, dcp, interleave)
    p_shards = shard_tokens(positions, dcp, interleave)
    outs, lses = [], []
    for k_r, v_r, p_r in zip(k_shards, v_shards, p_shards):
        o_r, l_r = dense_attention(q, k_r, v_r, scale, q_positions=q_positions, k_positions=p_r)
        outs.append(o_r)
        lses.append(l_r)
    return merge_by_hand(outs, lses)
