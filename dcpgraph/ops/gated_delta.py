"""Recurrent ops of a gated delta net (GDN) layer with explicit per-request state, varlen.

Both ops take the step's flattened tokens (requests separated by ``cu_seqlens_q [R+1]``, as every
dcpgraph step is laid out) and a state pool indexed by a per-request slot ``state_slots [R]``.
A row whose ``context_lens[r]`` is 0 starts from a zero state (a new or recomputed request, so a
freshly allocated slot needs no clearing); any other row continues from its slot. Each row's
final state is written back to its slot in place; a row with slot −1 (padding) writes nothing.
A prompt longer than the prefill chunk is therefore just several calls that carry the state.

``causal_conv1d_(x, weight, bias, conv_states, ...)``: depthwise causal convolution of kernel
``K`` over channels ``C``, ``x [T, C]``, ``weight [C, K]``, state ``conv_states [S, C, K−1]`` (the
last ``K−1`` inputs of the request), then SiLU when ``activation == "silu"``::

    y_t[c] = act(bias[c] + Σ_{j<K} weight[c, j] · x_{t−K+1+j}[c])      (x before the row: its state)

``gated_delta_rule_(q, k, v, g, beta, states, ...)``: ``q, k [T, Hk, Dk]``, ``v [T, Hv, Dv]``,
``g, beta [T, Hv]`` (``Hv`` a multiple of ``Hk``: value head ``h`` reads key head
``h // (Hv/Hk)``), state ``states [S, Hv, Dk, Dv]`` fp32. With ``q, k`` L2-normalised
(eps 1e-6) and ``q`` scaled by ``Dk^−½``, per head::

    S_t = e^{g_t} S_{t−1} + β_t k_t (v_t − e^{g_t} S_{t−1}ᵀ k_t)ᵀ,      o_t = S_tᵀ q_t

computed in chunks of ``chunk_size`` tokens (the UT/WY form: one triangular solve per chunk,
see :func:`gated_delta_chunk`), in fp32, output in ``v``'s dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NS = "dcpgraph"
L2NORM_EPS = 1e-6
ACTIVATIONS = ("silu", "none")

_lib = torch.library.Library(NS, "FRAGMENT")
# Canonical (stateless) forms, as a front end traces them: the whole token sequence is one request
# from a zero state. A later lowering gives them state pools and becomes the in-place forms below.
_lib.define("causal_conv1d(Tensor x, Tensor weight, Tensor? bias, str activation) -> Tensor")
_lib.define("gated_delta_rule(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, int chunk_size) -> Tensor")
_lib.define(
    "causal_conv1d_(Tensor x, Tensor weight, Tensor? bias, Tensor(a!) conv_states, Tensor state_slots, "
    "Tensor cu_seqlens_q, Tensor context_lens, str activation) -> Tensor"
)
_lib.define(
    "gated_delta_rule_(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) states, "
    "Tensor state_slots, Tensor cu_seqlens_q, Tensor context_lens, int chunk_size) -> Tensor"
)


def _rows(cu_seqlens_q: torch.Tensor, state_slots: torch.Tensor, context_lens: torch.Tensor):
    """``(start, end, slot, continues)`` per request row."""
    cu = cu_seqlens_q.tolist()
    return [(cu[r], cu[r + 1], int(s), int(c) > 0)
            for r, (s, c) in enumerate(zip(state_slots.tolist(), context_lens.tolist()))]


def causal_conv1d_(x, weight, bias, conv_states, state_slots, cu_seqlens_q, context_lens, activation):
    if activation not in ACTIVATIONS:
        raise ValueError(f"causal_conv1d_ activation must be one of {ACTIVATIONS}, got {activation!r}")
    kernel = weight.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    for start, end, slot, continues in _rows(cu_seqlens_q, state_slots, context_lens):
        if end == start:
            continue
        history = (conv_states[slot].to(weight.dtype) if continues and slot >= 0
                   else torch.zeros(weight.shape[0], kernel - 1, dtype=weight.dtype, device=x.device))
        window = torch.cat([history, x[start:end].t().to(weight.dtype)], dim=-1)  # [C, K-1+n]
        y = F.conv1d(window.unsqueeze(0), weight.unsqueeze(1), bias, groups=weight.shape[0])[0]
        if activation == "silu":
            y = F.silu(y)
        out[start:end] = y.t().to(x.dtype)
        if slot >= 0:
            conv_states[slot].copy_(window[:, window.shape[-1] - (kernel - 1):])
    return out


def l2_normalized(x: torch.Tensor) -> torch.Tensor:
    """``x / sqrt(Σx² + 1e-6)`` over the last dim."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def gated_delta_chunk(q, k, v, g, beta, state):
    """One chunk of the gated delta rule for all heads: ``q, k [H, C, Dk]`` (normalised, ``q``
    scaled), ``v [H, C, Dv]``, ``g, beta [H, C]``, ``state [H, Dk, Dv]`` → ``(o [H, C, Dv], state')``.

    With ``γ_t = Σ_{s≤t} g_s`` and ``u_t = β_t(v_t − e^{g_t} S_{t−1}ᵀ k_t)`` (the delta written at
    ``t``), ``S_t = e^{γ_t} S_0 + Σ_{s≤t} e^{γ_t−γ_s} k_s u_sᵀ``, so ``(I + A) U = βV − (β e^{γ} K) S_0``
    with ``A[t, s] = β_t e^{γ_t−γ_s} k_t·k_s`` for ``s < t``; then
    ``o_t = e^{γ_t} S_0ᵀ q_t + Σ_{s≤t} e^{γ_t−γ_s} (q_t·k_s) u_s`` and
    ``S_C = e^{γ_C} S_0 + Σ_s e^{γ_C−γ_s} k_s u_sᵀ``."""
    n = q.shape[1]
    gamma = g.cumsum(-1)  # [H, C]
    diff = gamma.unsqueeze(-1) - gamma.unsqueeze(-2)  # [H, t, s] = γ_t − γ_s
    lower_incl = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    decay = diff.masked_fill(~lower_incl, float("-inf")).exp()  # e^{γ_t−γ_s} for s ≤ t, else 0
    strict = decay.tril(-1)
    a = beta.unsqueeze(-1) * strict * (k @ k.transpose(-1, -2))
    system = a + torch.eye(n, dtype=q.dtype, device=q.device)
    rhs = beta.unsqueeze(-1) * v - (beta * gamma.exp()).unsqueeze(-1) * (k @ state)
    u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    o = gamma.exp().unsqueeze(-1) * (q @ state) + (decay * (q @ k.transpose(-1, -2))) @ u
    last = gamma[:, -1:]  # [H, 1]
    new_state = last.exp().unsqueeze(-1) * state + ((last - gamma).exp().unsqueeze(-1) * k).transpose(-1, -2) @ u
    return o, new_state


def gated_delta_rule_(q, k, v, g, beta, states, state_slots, cu_seqlens_q, context_lens, chunk_size):
    if chunk_size < 1:
        raise ValueError(f"gated_delta_rule_ chunk_size must be >= 1, got {chunk_size}")
    heads_v, dk, dv = v.shape[1], k.shape[-1], v.shape[-1]
    if heads_v % k.shape[1]:
        raise ValueError(f"gated_delta_rule_: {heads_v} value heads are not a multiple of {k.shape[1]} key heads")
    group = heads_v // k.shape[1]
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    f32 = torch.float32
    for start, end, slot, continues in _rows(cu_seqlens_q, state_slots, context_lens):
        if end == start:
            continue
        qh = l2_normalized(q[start:end].to(f32)).repeat_interleave(group, 1).transpose(0, 1) * dk ** -0.5
        kh = l2_normalized(k[start:end].to(f32)).repeat_interleave(group, 1).transpose(0, 1)
        vh = v[start:end].to(f32).transpose(0, 1)
        gh, bh = g[start:end].to(f32).t(), beta[start:end].to(f32).t()
        state = (states[slot].to(f32) if continues and slot >= 0
                 else torch.zeros(heads_v, dk, dv, dtype=f32, device=v.device))
        pieces = []
        for c in range(0, end - start, chunk_size):
            piece = slice(c, c + chunk_size)
            o, state = gated_delta_chunk(qh[:, piece], kh[:, piece], vh[:, piece], gh[:, piece], bh[:, piece], state)
            pieces.append(o)
        out[start:end] = torch.cat(pieces, dim=1).transpose(0, 1).to(v.dtype)
        if slot >= 0:
            states[slot].copy_(state.to(states.dtype))
    return out


def causal_conv1d(x, weight, bias, activation):
    """One request from a zero state: ``causal_conv1d_`` on a scratch one-slot pool."""
    scratch = torch.zeros(1, weight.shape[0], weight.shape[-1] - 1, dtype=weight.dtype, device=x.device)
    return causal_conv1d_(x, weight, bias, scratch, *_one_new_request(x), activation)


def gated_delta_rule(q, k, v, g, beta, chunk_size):
    """One request from a zero state: ``gated_delta_rule_`` on a scratch one-slot pool."""
    scratch = torch.zeros(1, v.shape[1], k.shape[-1], v.shape[-1], dtype=torch.float32, device=v.device)
    return gated_delta_rule_(q, k, v, g, beta, scratch, *_one_new_request(q), chunk_size)


def _one_new_request(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(state_slots, cu_seqlens_q, context_lens)`` of one new request over all of ``x``'s rows."""
    return (torch.zeros(1, dtype=torch.int64), torch.tensor([0, x.shape[0]], dtype=torch.int32),
            torch.zeros(1, dtype=torch.int32))


def _causal_conv1d_fake(x, weight, bias, conv_states, state_slots, cu_seqlens_q, context_lens, activation):
    return torch.empty_like(x)


def _gated_delta_rule_fake(q, k, v, g, beta, states, state_slots, cu_seqlens_q, context_lens, chunk_size):
    return torch.empty_like(v)


for _name, _kernel, _fake in (
    ("causal_conv1d_", causal_conv1d_, _causal_conv1d_fake),
    ("gated_delta_rule_", gated_delta_rule_, _gated_delta_rule_fake),
    ("causal_conv1d", causal_conv1d, lambda x, weight, bias, activation: torch.empty_like(x)),
    ("gated_delta_rule", gated_delta_rule, lambda q, k, v, g, beta, chunk_size: torch.empty_like(v)),
):
    _lib.impl(_name, _kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NS}::{_name}", _fake, lib=_lib)
