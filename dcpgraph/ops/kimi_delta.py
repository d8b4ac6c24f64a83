"""Kimi delta attention (KDA): the gated delta rule with a decay per key channel, varlen, with
explicit per-request state.

Laid out as every dcpgraph recurrent op (see :mod:`dcpgraph.ops.gated_delta`): the step's tokens
flattened, requests separated by ``cu_seqlens_q [R+1]``, a state pool indexed by a per-request
slot ``state_slots [R]``; a row whose ``context_lens[r]`` is 0 starts from a zero state, any other
continues from its slot; each row's final state is written back in place, slot −1 writes nothing.

``kimi_delta_rule_(q, k, v, g, beta, states, ...)``: ``q, k [T, H, Dk]``, ``v [T, H, Dv]``,
``g [T, H, Dk]`` (log-decay per key channel, ≤ 0), ``beta [T, H]``, state ``states [S, H, Dk, Dv]``
fp32. With ``q, k`` L2-normalised (eps 1e-6) and ``q`` scaled by ``Dk^−½``, per head::

    S_t = diag(e^{g_t}) S_{t−1} + β_t k_t (v_t − (diag(e^{g_t}) S_{t−1})ᵀ k_t)ᵀ,      o_t = S_tᵀ q_t

(the gated delta rule of a gated delta net is the case ``g_t[d] = g_t`` for every channel ``d``),
computed in chunks of ``chunk_size`` tokens (see :func:`kimi_delta_chunk`), in fp32, output in
``v``'s dtype.
"""

from __future__ import annotations

import torch

from .gated_delta import NS, _one_new_request, _rows, l2_normalized

_lib = torch.library.Library(NS, "FRAGMENT")
# The canonical (stateless) form a front end traces: one request from a zero state.
_lib.define("kimi_delta_rule(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, int chunk_size) -> Tensor")
_lib.define(
    "kimi_delta_rule_(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) states, "
    "Tensor state_slots, Tensor cu_seqlens_q, Tensor context_lens, int chunk_size) -> Tensor"
)


def kimi_delta_chunk(q, k, v, g, beta, state):
    """One chunk for all heads: ``q, k, g [H, C, Dk]`` (``q, k`` normalised, ``q`` scaled),
    ``v [H, C, Dv]``, ``beta [H, C]``, ``state [H, Dk, Dv]`` → ``(o [H, C, Dv], state')``.

    With ``Γ_t = Σ_{s≤t} g_s`` (a vector over key channels), ``D_{ts} = diag(e^{Γ_t−Γ_s})`` and
    ``u_t = β_t(v_t − (diag(e^{g_t}) S_{t−1})ᵀ k_t)`` (the delta written at ``t``),
    ``S_t = diag(e^{Γ_t}) S_0 + Σ_{s≤t} D_{ts} k_s u_sᵀ``, so ``(I + A) U = βV − β (e^{Γ} ⊙ K) S_0``
    with ``A[t, s] = β_t k_tᵀ D_{ts} k_s`` for ``s < t``; then
    ``o_t = S_0ᵀ (e^{Γ_t} ⊙ q_t) + Σ_{s≤t} (q_tᵀ D_{ts} k_s) u_s`` and
    ``S_C = diag(e^{Γ_C}) S_0 + Σ_s (e^{Γ_C−Γ_s} ⊙ k_s) u_sᵀ``. Every exponent is ≤ 0 (``g ≤ 0``),
    so nothing overflows."""
    n = q.shape[1]
    gamma = g.cumsum(1)  # [H, C, Dk]
    lower_incl = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    diff = gamma.unsqueeze(2) - gamma.unsqueeze(1)  # [H, t, s, Dk] = Γ_t − Γ_s
    decay = diff.masked_fill(~lower_incl.unsqueeze(-1), float("-inf")).exp()  # 0 where s > t
    kk = torch.einsum("htd,hsd,htsd->hts", k, k, decay).tril(-1)
    system = beta.unsqueeze(-1) * kk + torch.eye(n, dtype=q.dtype, device=q.device)
    rhs = beta.unsqueeze(-1) * (v - (gamma.exp() * k) @ state)
    u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    qk = torch.einsum("htd,hsd,htsd->hts", q, k, decay)
    o = (gamma.exp() * q) @ state + qk @ u
    last = gamma[:, -1:]  # [H, 1, Dk]
    new_state = last.transpose(1, 2).exp() * state + ((last - gamma).exp() * k).transpose(-1, -2) @ u
    return o, new_state


def kimi_delta_rule_(q, k, v, g, beta, states, state_slots, cu_seqlens_q, context_lens, chunk_size):
    if chunk_size < 1:
        raise ValueError(f"kimi_delta_rule_ chunk_size must be >= 1, got {chunk_size}")
    heads, dk, dv = v.shape[1], k.shape[-1], v.shape[-1]
    if q.shape[1] != heads or k.shape[1] != heads or tuple(g.shape[1:]) != (heads, dk):
        raise ValueError(f"kimi_delta_rule_: q {tuple(q.shape)}, k {tuple(k.shape)}, g {tuple(g.shape)} must all have "
                         f"the {heads} heads of v (and g the key dim {dk})")
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    f32 = torch.float32
    for start, end, slot, continues in _rows(cu_seqlens_q, state_slots, context_lens):
        if end == start:
            continue
        qh = l2_normalized(q[start:end].to(f32)).transpose(0, 1) * dk ** -0.5
        kh = l2_normalized(k[start:end].to(f32)).transpose(0, 1)
        vh = v[start:end].to(f32).transpose(0, 1)
        gh, bh = g[start:end].to(f32).transpose(0, 1), beta[start:end].to(f32).t()
        state = (states[slot].to(f32) if continues and slot >= 0
                 else torch.zeros(heads, dk, dv, dtype=f32, device=v.device))
        pieces = []
        for c in range(0, end - start, chunk_size):
            piece = slice(c, c + chunk_size)
            o, state = kimi_delta_chunk(qh[:, piece], kh[:, piece], vh[:, piece], gh[:, piece], bh[:, piece], state)
            pieces.append(o)
        out[start:end] = torch.cat(pieces, dim=1).transpose(0, 1).to(v.dtype)
        if slot >= 0:
            states[slot].copy_(state.to(states.dtype))
    return out


def kimi_delta_rule(q, k, v, g, beta, chunk_size):
    """One request from a zero state: ``kimi_delta_rule_`` on a scratch one-slot pool."""
    scratch = torch.zeros(1, v.shape[1], k.shape[-1], v.shape[-1], dtype=torch.float32, device=v.device)
    return kimi_delta_rule_(q, k, v, g, beta, scratch, *_one_new_request(q), chunk_size)


def _kimi_delta_rule_fake(q, k, v, g, beta, states, state_slots, cu_seqlens_q, context_lens, chunk_size):
    return torch.empty_like(v)


for _name, _kernel, _fake in (
    ("kimi_delta_rule_", kimi_delta_rule_, _kimi_delta_rule_fake),
    ("kimi_delta_rule", kimi_delta_rule, lambda q, k, v, g, beta, chunk_size: torch.empty_like(v)),
):
    _lib.impl(_name, _kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NS}::{_name}", _fake, lib=_lib)
