"""The Mamba-2 selective state-space scan (SSD) with explicit per-request state, varlen.

Same step layout as :mod:`dcpgraph.ops.gated_delta`: the step's flattened tokens, requests
separated by ``cu_seqlens_q [R+1]``, a state pool indexed by ``state_slots [R]``; a row whose
``context_lens[r]`` is 0 starts from a zero state, any other continues from its slot; each row's
final state is written back in place, slot −1 (padding) writes nothing.

``mamba2_scan_(x, dt, A, B, C, D, dt_bias, states, ...)``: ``x [T, H, P]`` (heads of ``P``
channels), raw time steps ``dt [T, H]``, per-head ``A [H]`` (negative, ``−exp(A_log)``),
``B, C [T, G, N]`` shared by the ``H/G`` heads of each group (head ``h`` reads group
``h // (H/G)``), skip ``D [H]``, ``dt_bias [H]``, state ``states [S, H, P, N]`` fp32. Per head::

    Δ_t = clamp(softplus(dt_t + dt_bias), dt_min, dt_max)
    S_t = e^{Δ_t A} S_{t−1} + Δ_t x_t B_tᵀ                   ([P, N])
    y_t = S_t C_t + D x_t

computed in chunks of ``chunk_size`` tokens (:func:`ssd_chunk`), in fp32, output in ``x``'s dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .gated_delta import NS, _one_new_request, _rows

_lib = torch.library.Library(NS, "FRAGMENT")
# Canonical (stateless) form, as a front end traces it: one request from a zero state.
_lib.define("mamba2_scan(Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor D, Tensor dt_bias, "
            "float dt_min, float dt_max, int chunk_size) -> Tensor")
_lib.define(
    "mamba2_scan_(Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor D, Tensor dt_bias, Tensor(a!) states, "
    "Tensor state_slots, Tensor cu_seqlens_q, Tensor context_lens, float dt_min, float dt_max, int chunk_size) -> Tensor"
)


def discretized_dt(dt: torch.Tensor, dt_bias: torch.Tensor, dt_min: float, dt_max: float) -> torch.Tensor:
    """``clamp(softplus(dt + dt_bias), dt_min, dt_max)`` in fp32."""
    return F.softplus(dt.float() + dt_bias.float()).clamp(min=dt_min, max=dt_max)


def ssd_chunk(x, delta, a, b, c, state):
    """One chunk for all heads: ``x [H, L, P]``, ``delta [H, L]`` (Δ), ``a [H]`` (A), ``b, c
    [H, L, N]``, ``state [H, P, N]`` → ``(y [H, L, P], state')`` without the ``D`` skip.

    With ``γ_t = Σ_{s≤t} Δ_s A`` the recurrence unrolls to
    ``S_t = e^{γ_t} S_0 + Σ_{s≤t} e^{γ_t−γ_s} Δ_s x_s b_sᵀ``, so
    ``y_t = e^{γ_t} S_0 c_t + Σ_{s≤t} e^{γ_t−γ_s} (c_t·b_s) Δ_s x_s``."""
    n = x.shape[1]
    gamma = (delta * a.unsqueeze(-1)).cumsum(-1)  # [H, L]
    diff = gamma.unsqueeze(-1) - gamma.unsqueeze(-2)  # [H, t, s] = γ_t − γ_s
    causal = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
    decay = diff.masked_fill(~causal, float("-inf")).exp()
    xd = x * delta.unsqueeze(-1)  # Δ_s x_s
    y = (decay * (c @ b.transpose(-1, -2))) @ xd + gamma.exp().unsqueeze(-1) * (c @ state.transpose(-1, -2))
    last = gamma[:, -1:]
    new_state = last.exp().unsqueeze(-1) * state + (xd * (last - gamma).exp().unsqueeze(-1)).transpose(-1, -2) @ b
    return y, new_state


def mamba2_scan_(x, dt, A, B, C, D, dt_bias, states, state_slots, cu_seqlens_q, context_lens, dt_min, dt_max,
                 chunk_size):
    if chunk_size < 1:
        raise ValueError(f"mamba2_scan_ chunk_size must be >= 1, got {chunk_size}")
    heads, head_dim = x.shape[1], x.shape[2]
    groups, state_size = B.shape[1], B.shape[2]
    if heads % groups:
        raise ValueError(f"mamba2_scan_: {heads} heads are not a multiple of {groups} groups")
    per_group = heads // groups
    f32 = torch.float32
    a = A.to(f32)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    for start, end, slot, continues in _rows(cu_seqlens_q, state_slots, context_lens):
        if end == start:
            continue
        xh = x[start:end].to(f32).transpose(0, 1)  # [H, n, P]
        delta = discretized_dt(dt[start:end], dt_bias, dt_min, dt_max).t()  # [H, n]
        bh = B[start:end].to(f32).repeat_interleave(per_group, 1).transpose(0, 1)  # [H, n, N]
        ch = C[start:end].to(f32).repeat_interleave(per_group, 1).transpose(0, 1)
        state = (states[slot].to(f32) if continues and slot >= 0
                 else torch.zeros(heads, head_dim, state_size, dtype=f32, device=x.device))
        pieces = []
        for first in range(0, end - start, chunk_size):
            piece = slice(first, first + chunk_size)
            y, state = ssd_chunk(xh[:, piece], delta[:, piece], a, bh[:, piece], ch[:, piece], state)
            pieces.append(y)
        y = torch.cat(pieces, dim=1) + D.to(f32)[:, None, None] * xh
        out[start:end] = y.transpose(0, 1).to(x.dtype)
        if slot >= 0:
            states[slot].copy_(state.to(states.dtype))
    return out


def mamba2_scan(x, dt, A, B, C, D, dt_bias, dt_min, dt_max, chunk_size):
    """One request from a zero state: ``mamba2_scan_`` on a scratch one-slot pool."""
    scratch = torch.zeros(1, x.shape[1], x.shape[2], B.shape[2], dtype=torch.float32, device=x.device)
    return mamba2_scan_(x, dt, A, B, C, D, dt_bias, scratch, *_one_new_request(x), dt_min, dt_max, chunk_size)


def _mamba2_scan_fake(x, dt, A, B, C, D, dt_bias, states, state_slots, cu_seqlens_q, context_lens, dt_min, dt_max,
                      chunk_size):
    return torch.empty_like(x)


for _name, _kernel, _fake in (
    ("mamba2_scan_", mamba2_scan_, _mamba2_scan_fake),
    ("mamba2_scan", mamba2_scan, lambda x, dt, A, B, C, D, dt_bias, dt_min, dt_max, chunk_size: torch.empty_like(x)),
):
    _lib.impl(_name, _kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NS}::{_name}", _fake, lib=_lib)
