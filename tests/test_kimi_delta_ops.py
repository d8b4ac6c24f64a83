"""The Kimi delta attention op against HF's own torch implementations (kimi_linear's
``chunk_kimi_delta_attention`` and ``recurrent_kimi_delta_attention``) and against a per-token
recurrence written here, with state carried across calls, varlen rows and padding."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import dcpgraph.ops.kimi_delta  # noqa: F401  (registers the op)

hf = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
ops = torch.ops.dcpgraph


def _inputs(seed, tokens, heads, dk, dv):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, heads, dk, generator=gen)
    k = torch.randn(tokens, heads, dk, generator=gen)
    v = torch.randn(tokens, heads, dv, generator=gen)
    g = -F.softplus(torch.randn(tokens, heads, dk, generator=gen)) * 0.5  # a decay per key channel
    beta = torch.sigmoid(torch.randn(tokens, heads, generator=gen))
    state = torch.randn(heads, dk, dv, generator=gen) * 0.1
    return q, k, v, g, beta, state


def _run(q, k, v, g, beta, states, slots, cu, context, chunk=64):
    return ops.kimi_delta_rule_(q, k, v, g, beta, states, torch.tensor(slots), torch.tensor(cu, dtype=torch.int32),
                                torch.tensor(context, dtype=torch.int32), chunk)


def naive_kimi_delta(q, k, v, g, beta, state):
    """Token by token, head by head: S ← diag(e^g) S; S ← S + β k (v − Sᵀk)ᵀ; o = Sᵀ q (q, k
    normalised, q scaled by Dk^−½)."""
    q = F.normalize(q, dim=-1, eps=0) * q.shape[-1] ** -0.5  # eps irrelevant at these norms
    k = F.normalize(k, dim=-1, eps=0)
    state = state.clone()
    out = torch.zeros_like(v)
    for t in range(q.shape[0]):
        for h in range(v.shape[1]):
            s = g[t, h].exp().unsqueeze(-1) * state[h]
            s = s + beta[t, h] * torch.outer(k[t, h], v[t, h] - s.t() @ k[t, h])
            state[h] = s
            out[t, h] = s.t() @ q[t, h]
    return out, state


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**16), tokens=st.integers(1, 40), heads=st.integers(1, 3), dk=st.sampled_from([4, 8]),
       dv=st.sampled_from([4, 6]), chunk=st.sampled_from([1, 4, 16, 64]), continues=st.booleans())
def test_kimi_delta_rule_matches_hf_chunked(seed, tokens, heads, dk, dv, chunk, continues):
    q, k, v, g, beta, state = _inputs(seed, tokens, heads, dk, dv)
    states = state.unsqueeze(0).clone()
    out = _run(q, k, v, g, beta, states, [0], [0, tokens], [5 if continues else 0], chunk)
    ref, ref_state = hf.chunk_kimi_delta_attention(
        q[None], k[None], v[None], g=g[None], beta=beta[None], chunk_size=16,
        initial_state=state[None] if continues else None, output_final_state=True, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(out, ref[0], atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(states[0], ref_state[0], atol=2e-4, rtol=2e-4)


@settings(max_examples=5, deadline=None)
@given(seed=st.integers(0, 2**16), heads=st.integers(1, 3), dk=st.sampled_from([4, 8]), dv=st.sampled_from([4, 6]))
def test_kimi_delta_rule_decode_step_matches_hf_recurrent(seed, heads, dk, dv):
    """One decode token continuing a state equals HF's one-token recurrent update."""
    q, k, v, g, beta, state = _inputs(seed, 1, heads, dk, dv)
    states = state.unsqueeze(0).clone()
    out = _run(q, k, v, g, beta, states, [0], [0, 1], [9])
    ref, ref_state = hf.recurrent_kimi_delta_attention(
        q[None], k[None], v[None], g=g[None], beta=beta[None], initial_state=state[None], output_final_state=True,
        use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(out, ref[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states[0], ref_state[0], atol=1e-5, rtol=1e-5)


def test_kimi_delta_rule_matches_a_per_token_recurrence_across_calls():
    """A 37-token prompt as calls of 16, 16, 4 and a decode step of 1 equals the recurrence."""
    q, k, v, g, beta, state = _inputs(3, 37, 2, 8, 6)
    ref, ref_state = naive_kimi_delta(q, k, v, g, beta, torch.zeros_like(state))
    states = torch.full((3, *state.shape), float("nan"))  # slot 1; a new request ignores stale contents
    outs, start = [], 0
    for n in (16, 16, 4, 1):
        piece = slice(start, start + n)
        outs.append(_run(q[piece], k[piece], v[piece], g[piece], beta[piece], states, [1], [0, n], [start], chunk=8))
        start += n
    torch.testing.assert_close(torch.cat(outs), ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(states[1], ref_state, atol=1e-4, rtol=1e-4)
    assert torch.isnan(states[0]).all() and torch.isnan(states[2]).all()


def test_kimi_delta_rule_varlen_rows_use_their_own_slots_and_padding_writes_nothing():
    q, k, v, g, beta, state = _inputs(7, 9, 2, 4, 4)
    states = torch.stack([state, state * 2, state * 3])
    out = _run(q, k, v, g, beta, states, [2, -1, 0], [0, 5, 6, 9], [0, 3, 4], chunk=2)
    ref_a, state_a = naive_kimi_delta(q[:5], k[:5], v[:5], g[:5], beta[:5], torch.zeros_like(state))
    ref_c, state_c = naive_kimi_delta(q[6:], k[6:], v[6:], g[6:], beta[6:], state)
    torch.testing.assert_close(out[:5], ref_a, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out[6:], ref_c, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(states[2], state_a, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(states[0], state_c, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(states[1], state * 2)  # the padding row's slot −1 wrote nothing


def test_kimi_delta_rule_refuses_bad_settings_by_name():
    q, k, v, g, beta, state = _inputs(0, 2, 2, 4, 4)
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        _run(q, k, v, g, beta, state[None], [0], [0, 2], [0], chunk=0)
    with pytest.raises(ValueError, match="must all have"):
        _run(q, k, v, g[..., :2], beta, state[None], [0], [0, 2], [0])
