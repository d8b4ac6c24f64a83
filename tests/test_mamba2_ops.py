"""The Mamba-2 scan op against HF's own torch implementations (bamba's ``mamba2_chunk_scan`` and
``mamba2_selective_state_update``, which run without mamba_ssm) and against a per-token
recurrence written here, including state carried across calls, varlen rows and padding."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import dcpgraph.ops  # noqa: F401  (registers the ops)

hf = pytest.importorskip("transformers.models.bamba.modeling_bamba")
ops = torch.ops.dcpgraph
INF = float("inf")


def _inputs(seed, tokens, groups, per_group, head_dim, state_size):
    gen = torch.Generator().manual_seed(seed)
    heads = groups * per_group
    x = torch.randn(tokens, heads, head_dim, generator=gen)
    dt = torch.randn(tokens, heads, generator=gen)
    a = -torch.rand(heads, generator=gen) * 2 - 0.1
    b = torch.randn(tokens, groups, state_size, generator=gen)
    c = torch.randn(tokens, groups, state_size, generator=gen)
    d = torch.randn(heads, generator=gen)
    dt_bias = torch.randn(heads, generator=gen)
    state = torch.randn(heads, head_dim, state_size, generator=gen) * 0.3
    return x, dt, a, b, c, d, dt_bias, state


def _run(inputs, states, slots, cu, context, dt_min=0.0, dt_max=INF, chunk=4):
    x, dt, a, b, c, d, dt_bias = inputs
    return ops.mamba2_scan_(x, dt, a, b, c, d, dt_bias, states, torch.tensor(slots),
                            torch.tensor(cu, dtype=torch.int32), torch.tensor(context, dtype=torch.int32),
                            dt_min, dt_max, chunk)


def naive_mamba2(x, dt, a, b, c, d, dt_bias, state, dt_min=0.0, dt_max=INF):
    """Token by token: Δ = clamp(softplus(dt + dt_bias)); S ← e^{ΔA} S + Δ x Bᵀ; y = S C + D x."""
    per_group = x.shape[1] // b.shape[1]
    b, c = b.repeat_interleave(per_group, 1), c.repeat_interleave(per_group, 1)
    state = state.clone()
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for h in range(x.shape[1]):
            delta = F.softplus(dt[t, h] + dt_bias[h]).clamp(dt_min, dt_max)
            state[h] = (delta * a[h]).exp() * state[h] + delta * torch.outer(x[t, h], b[t, h])
            out[t, h] = state[h] @ c[t, h] + d[h] * x[t, h]
    return out, state


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**16), tokens=st.integers(1, 30), groups=st.integers(1, 2),
       per_group=st.sampled_from([1, 2]), head_dim=st.sampled_from([2, 4]), state_size=st.sampled_from([3, 8]),
       chunk=st.sampled_from([1, 4, 16]), hf_chunk=st.sampled_from([4, 8]), continues=st.booleans(),
       dt_min=st.sampled_from([0.0, 0.5]))
def test_mamba2_scan_matches_hf_chunk_scan(seed, tokens, groups, per_group, head_dim, state_size, chunk, hf_chunk,
                                           continues, dt_min):
    x, dt, a, b, c, d, dt_bias, state = _inputs(seed, tokens, groups, per_group, head_dim, state_size)
    states = state.unsqueeze(0).clone()
    out = _run((x, dt, a, b, c, d, dt_bias), states, [0], [0, tokens], [3 if continues else 0], dt_min, INF, chunk)
    ref, ref_state = hf.mamba2_chunk_scan(
        x[None], dt[None], a, b[None], c[None], chunk_size=hf_chunk, D=d, dt_bias=dt_bias,
        initial_states=state[None] if continues else None, dt_softplus=True, dt_limit=(dt_min, INF),
        return_final_states=True)
    torch.testing.assert_close(out, ref[0], atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(states[0], ref_state[0], atol=2e-4, rtol=2e-4)


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**16), groups=st.integers(1, 2), per_group=st.sampled_from([1, 3]))
def test_mamba2_scan_decode_step_matches_hf_selective_state_update(seed, groups, per_group):
    x, dt, a, b, c, d, dt_bias, state = _inputs(seed, 1, groups, per_group, 4, 5)
    states = state.unsqueeze(0).clone()
    out = _run((x, dt, a, b, c, d, dt_bias), states, [0], [0, 1], [9])
    hf_state = state[None].clone()
    heads, head_dim, n = state.shape
    ref = hf.mamba2_selective_state_update(
        hf_state, x, dt[:, :, None].expand(-1, -1, head_dim), a[:, None, None].expand(-1, head_dim, n),
        b, c, d[:, None].expand(-1, head_dim), dt_bias=dt_bias[:, None].expand(-1, head_dim), dt_softplus=True)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states, hf_state, atol=1e-5, rtol=1e-5)


def test_mamba2_scan_matches_a_per_token_recurrence_across_calls():
    """A 23-token prompt as calls of 9, 9, 4 and a decode step of 1 equals the recurrence; the
    dt floor (nemotron_h's ``time_step_min``) clamps some steps here."""
    x, dt, a, b, c, d, dt_bias, state = _inputs(3, 23, 2, 2, 4, 6)
    ref, ref_state = naive_mamba2(x, dt, a, b, c, d, dt_bias, torch.zeros_like(state), dt_min=0.3)
    states = torch.full((3, *state.shape), float("nan"))  # slot 1; a new request ignores stale contents
    outs, start = [], 0
    for n in (9, 9, 4, 1):
        piece = slice(start, start + n)
        outs.append(_run((x[piece], dt[piece], a, b[piece], c[piece], d, dt_bias), states, [1], [0, n], [start],
                         dt_min=0.3, chunk=4))
        start += n
    torch.testing.assert_close(torch.cat(outs), ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(states[1], ref_state, atol=1e-4, rtol=1e-4)
    assert torch.isnan(states[0]).all() and torch.isnan(states[2]).all()


def test_mamba2_scan_varlen_rows_use_their_own_slots_and_padding_writes_nothing():
    x, dt, a, b, c, d, dt_bias, state = _inputs(7, 9, 1, 2, 2, 3)
    states = torch.stack([state, state * 2, state * 3])
    out = _run((x, dt, a, b, c, d, dt_bias), states, [2, -1, 0], [0, 5, 6, 9], [0, 3, 4])
    ref_a, state_a = naive_mamba2(x[:5], dt[:5], a, b[:5], c[:5], d, dt_bias, torch.zeros_like(state))
    ref_c, state_c = naive_mamba2(x[6:], dt[6:], a, b[6:], c[6:], d, dt_bias, state)
    torch.testing.assert_close(out[:5], ref_a, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out[6:], ref_c, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(states[2], state_a, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(states[0], state_c, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(states[1], state * 2)  # the padding row's slot −1 wrote nothing


def test_mamba2_scan_refuses_bad_settings_by_name():
    x, dt, a, b, c, d, dt_bias, state = _inputs(0, 2, 1, 2, 2, 3)
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        _run((x, dt, a, b, c, d, dt_bias), state[None], [0], [0, 2], [0], chunk=0)
    b3 = torch.zeros(2, 3, 3)  # 2 heads over 3 groups
    with pytest.raises(ValueError, match="2 heads are not a multiple of 3 groups"):
        _run((x, dt, a, b3, b3, d, dt_bias), state[None], [0], [0, 2], [0])
