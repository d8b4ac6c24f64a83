"""The gated delta net ops against HF's own torch implementations (qwen3_next) and against a
per-token recurrence written here, including state carried across calls and varlen rows."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import dcpgraph.ops  # noqa: F401  (registers the ops)

hf = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
ops = torch.ops.dcpgraph


def _inputs(seed, tokens, hk, group, dk, dv):
    gen = torch.Generator().manual_seed(seed)
    hv = hk * group
    q = torch.randn(tokens, hk, dk, generator=gen)
    k = torch.randn(tokens, hk, dk, generator=gen)
    v = torch.randn(tokens, hv, dv, generator=gen)
    g = -F.softplus(torch.randn(tokens, hv, generator=gen))
    beta = torch.sigmoid(torch.randn(tokens, hv, generator=gen))
    state = torch.randn(hv, dk, dv, generator=gen) * 0.1
    return q, k, v, g, beta, state


def _run(q, k, v, g, beta, states, slots, cu, context, chunk=64):
    return ops.gated_delta_rule_(q, k, v, g, beta, states, torch.tensor(slots), torch.tensor(cu, dtype=torch.int32),
                                 torch.tensor(context, dtype=torch.int32), chunk)


def naive_gated_delta(q, k, v, g, beta, state):
    """Token by token: S ← e^g S; S ← S + β k (v − Sᵀk)ᵀ; o = Sᵀ q (q, k normalised, q scaled)."""
    group = v.shape[1] // k.shape[1]
    q = F.normalize(q, dim=-1, eps=0).repeat_interleave(group, 1)  # eps irrelevant at these norms
    k = F.normalize(k, dim=-1, eps=0).repeat_interleave(group, 1)
    q = q * q.shape[-1] ** -0.5
    state = state.clone()
    out = torch.zeros_like(v)
    for t in range(q.shape[0]):
        for h in range(v.shape[1]):
            s = state[h] * g[t, h].exp()
            s = s + beta[t, h] * torch.outer(k[t, h], v[t, h] - s.t() @ k[t, h])
            state[h] = s
            out[t, h] = s.t() @ q[t, h]
    return out, state


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**16), tokens=st.integers(1, 40), hk=st.integers(1, 2), group=st.sampled_from([1, 2]),
       dk=st.sampled_from([4, 8]), dv=st.sampled_from([4, 6]), chunk=st.sampled_from([1, 4, 16, 64]),
       continues=st.booleans())
def test_gated_delta_rule_matches_hf_chunked(seed, tokens, hk, group, dk, dv, chunk, continues):
    q, k, v, g, beta, state = _inputs(seed, tokens, hk, group, dk, dv)
    states = state.unsqueeze(0).clone()
    out = _run(q, k, v, g, beta, states, [0], [0, tokens], [5 if continues else 0], chunk)
    ref, ref_state = hf.torch_chunk_gated_delta_rule(
        q[None], k[None], v[None], g=g[None], beta=beta[None], initial_state=state[None] if continues else None,
        output_final_state=True, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(out, ref[0], atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(states[0], ref_state[0], atol=2e-4, rtol=2e-4)


def test_gated_delta_rule_matches_a_per_token_recurrence_across_calls():
    """A 37-token prompt as calls of 16, 16, 4 and a decode step of 1 equals the recurrence."""
    q, k, v, g, beta, state = _inputs(3, 37, 2, 2, 8, 6)
    ref, ref_state = naive_gated_delta(q, k, v, g, beta, torch.zeros_like(state))
    states = torch.full((3, *state.shape), float("nan"))  # slot 1; a new request ignores stale contents
    outs, start = [], 0
    for n in (16, 16, 4, 1):
        piece = slice(start, start + n)
        outs.append(_run(q[piece], k[piece], v[piece], g[piece], beta[piece], states, [1], [0, n], [start], chunk=8))
        start += n
    torch.testing.assert_close(torch.cat(outs), ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(states[1], ref_state, atol=1e-4, rtol=1e-4)
    assert torch.isnan(states[0]).all() and torch.isnan(states[2]).all()


def test_gated_delta_rule_varlen_rows_use_their_own_slots_and_padding_writes_nothing():
    q, k, v, g, beta, state = _inputs(7, 9, 1, 2, 4, 4)
    states = torch.stack([state, state * 2, state * 3])
    out = _run(q, k, v, g, beta, states, [2, -1, 0], [0, 5, 6, 9], [0, 3, 4])
    ref_a, state_a = naive_gated_delta(q[:5], k[:5], v[:5], g[:5], beta[:5], torch.zeros_like(state))
    ref_c, state_c = naive_gated_delta(q[6:], k[6:], v[6:], g[6:], beta[6:], state)
    torch.testing.assert_close(out[:5], ref_a, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out[6:], ref_c, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(states[2], state_a, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(states[0], state_c, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(states[1], state * 2)  # the padding row's slot −1 wrote nothing


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**16), tokens=st.integers(1, 12), channels=st.integers(1, 8), kernel=st.integers(2, 5),
       split=st.integers(0, 12), bias=st.booleans())
def test_causal_conv1d_matches_hf_prefill_then_decode(seed, tokens, channels, kernel, split, bias):
    """HF's whole-sequence convolution equals ours as two calls carrying the conv state, and HF's
    one-token update (its state holds ``K`` inputs) equals our next decode step."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens + 1, channels, generator=gen)
    weight = torch.randn(channels, kernel, generator=gen)
    b = torch.randn(channels, generator=gen) if bias else None
    split = min(split, tokens)
    states = torch.zeros(2, channels, kernel - 1)
    outs = []
    for start, end in ((0, split), (split, tokens), (tokens, tokens + 1)):
        outs.append(ops.causal_conv1d_(x[start:end], weight, b, states, torch.tensor([1]),
                                       torch.tensor([0, end - start], dtype=torch.int32),
                                       torch.tensor([start], dtype=torch.int32), "silu"))
    ref = hf.causal_conv1d_fn(x[:tokens].t()[None], weight, b, activation="silu")[0].t()
    hf_state = F.pad(x[:tokens].t(), (kernel, 0))[None, :, -kernel:].clone()
    ref_step = hf.causal_conv1d_update(x[tokens:].t()[None], hf_state, weight, b, "silu")[0].t()
    torch.testing.assert_close(torch.cat(outs), torch.cat([ref, ref_step]), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states[1], hf_state[0, :, 1:])
    assert not states[0].any()


def test_ops_refuse_bad_settings_by_name():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="activation must be one of"):
        ops.causal_conv1d_(x, torch.zeros(3, 4), None, torch.zeros(1, 3, 3), torch.tensor([0]),
                           torch.tensor([0, 2], dtype=torch.int32), torch.tensor([0], dtype=torch.int32), "gelu")
    q, k, v, g, beta, state = _inputs(0, 2, 2, 1, 4, 4)
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        _run(q, k, v, g, beta, state[None], [0], [0, 2], [0], chunk=0)
