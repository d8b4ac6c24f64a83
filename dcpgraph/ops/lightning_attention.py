"""Lightning attention (MiniMax's linear attention with per-head decay), explicit per-request state, varlen.

Same step layout as :mod:`dcpgraph.ops.gated_delta`: the step's flattened tokens, requests
separated by ``cu_seqlens_q [R+1]``, a state pool indexed by ``state_slots [R]``; a row whose
``context_lens[r]`` is 0 starts from a zero state, any other continues from its slot; each row's
final state is written back in place, slot −1 (padding) writes nothing.

``lightning_attention_(q, k, v, slope, states, ...)``: ``q, k, v [T, H, D]``, a positive decay
rate per head ``slope [H]``, state ``states [S, H, D, D]`` fp32. Per head, with ``λ = e^{−slope}``::

    S_t = λ S_{t−1} + k_tᵀ v_t,      o_t = q_t S_t                   (no softmax, no scaling)

computed in blocks of ``block_size`` tokens (:func:`lightning_block`), in fp32, output in ``v``'s
dtype. The block split changes only rounding: block boundaries need not match HF's.
"""

from __future__ import annotations

import torch

from .gated_delta import NS, _one_new_request, _rows

_lib = torch.library.Library(NS, "FRAGMENT")
# Canonical (stateless) form, as a front end traces it: one request from a zero state.
_lib.define("lightning_attention(Tensor q, Tensor k, Tensor v, Tensor slope, int block_size) -> Tensor")
_lib.define(
    "lightning_attention_(Tensor q, Tensor k, Tensor v, Tensor slope, Tensor(a!) states, Tensor state_slots, "
    "Tensor cu_seqlens_q, Tensor context_lens, int block_size) -> Tensor"
)


def lightning_block(q, k, v, slope, state):
    """One block for all heads: ``q, k, v [H, n, D]``, ``slope [H]``, ``state [H, D, D]`` →
    ``(o [H, n, D], state')``.

    Unrolled from the block's first token (index 0), ``S_i = λ^{i+1} S_0 + Σ_{j≤i} λ^{i−j} k_jᵀ v_j``, so
    ``o_i = λ^{i+1} q_i S_0 + Σ_{j≤i} λ^{i−j} (q_i·k_j) v_j`` and
    ``S_n = λ^n S_0 + Σ_j λ^{n−1−j} k_jᵀ v_j`` (HF's query, diagonal, key and block decays)."""
    n = q.shape[1]
    s = slope[:, None]  # [H, 1]
    position = torch.arange(n, dtype=q.dtype, device=q.device)
    gap = position[:, None] - position[None, :]  # i − j
    diagonal = torch.exp(-s[:, :, None] * gap.clamp(min=0)).masked_fill(gap < 0, 0.0)  # [H, n, n]
    query_decay = torch.exp(-s * (position + 1))[..., None]  # [H, n, 1]
    key_decay = torch.exp(-s * (n - 1 - position))[..., None]
    o = (q * query_decay) @ state + ((q @ k.transpose(-1, -2)) * diagonal) @ v
    new_state = torch.exp(-s * n)[..., None] * state + (k * key_decay).transpose(-1, -2) @ v
    return o, new_state


def lightning_attention_(q, k, v, slope, states, state_slots, cu_seqlens_q, context_lens, block_size):
    if block_size < 1:
        raise ValueError(f"lightning_attention_ block_size must be >= 1, got {block_size}")
    if not (q.shape == k.shape and q.shape[:2] == v.shape[:2] and slope.shape == q.shape[1:2]):
        raise ValueError(f"lightning_attention_: q {tuple(q.shape)}, k {tuple(k.shape)} must match, v "
                         f"{tuple(v.shape)} share their tokens and heads, slope {tuple(slope.shape)} be [heads]")
    heads, dk, dv = q.shape[1], q.shape[2], v.shape[2]
    f32 = torch.float32
    rate = slope.to(f32)
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    for start, end, slot, continues in _rows(cu_seqlens_q, state_slots, context_lens):
        if end == start:
            continue
        qh, kh, vh = (t[start:end].to(f32).transpose(0, 1) for t in (q, k, v))  # [H, n, D]
        state = (states[slot].to(f32) if continues and slot >= 0
                 else torch.zeros(heads, dk, dv, dtype=f32, device=v.device))
        pieces = []
        for first in range(0, end - start, block_size):
            piece = slice(first, first + block_size)
            o, state = lightning_block(qh[:, piece], kh[:, piece], vh[:, piece], rate, state)
            pieces.append(o)
        out[start:end] = torch.cat(pieces, dim=1).transpose(0, 1).to(v.dtype)
        if slot >= 0:
            states[slot].copy_(state.to(states.dtype))
    return out


def lightning_attention(q, k, v, slope, block_size):
    """One request from a zero state: ``lightning_attention_`` on a scratch one-slot pool."""
    scratch = torch.zeros(1, q.shape[1], q.shape[2], v.shape[2], dtype=torch.float32, device=v.device)
    return lightning_attention_(q, k, v, slope, scratch, *_one_new_request(q), block_size)


def _lightning_attention_fake(q, k, v, slope, states, state_slots, cu_seqlens_q, context_lens, block_size):
    return torch.empty_like(v)


for _name, _kernel, _fake in (
    ("lightning_attention_", lightning_attention_, _lightning_attention_fake),
    ("lightning_attention", lightning_attention, lambda q, k, v, slope, block_size: torch.empty_like(v)),
):
    _lib.impl(_name, _kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NS}::{_name}", _fake, lib=_lib)
