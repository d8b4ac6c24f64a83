"""The lightning attention op and layer against HF transformers' own ``MiniMaxLightningAttention``
(its block-wise prefill and its per-token decode from a cache) and against a per-token recurrence
written here, including state carried across calls, varlen rows and padding slots."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dcpgraph.ops  # noqa: F401  (registers the ops)
from dcpgraph.frontends.lightning_attention import canonical_weights, is_lightning_attention
from dcpgraph.ops.lightning_attention_layer import lightning_attention_layer

hf = pytest.importorskip("transformers.models.minimax.modeling_minimax")
transformers = pytest.importorskip("transformers")
ops = torch.ops.dcpgraph


def naive_lightning(q, k, v, slope, state):
    """Token by token, per head: S ← e^{−slope} S + kᵀv; o = q S."""
    state = state.clone()
    out = torch.zeros_like(v)
    for t in range(q.shape[0]):
        for h in range(q.shape[1]):
            state[h] = torch.exp(-slope[h]) * state[h] + torch.outer(k[t, h], v[t, h])
            out[t, h] = q[t, h] @ state[h]
    return out, state


def _inputs(seed, tokens, heads, dim):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(tokens, heads, dim, generator=gen) for _ in range(3))
    slope = torch.rand(heads, generator=gen) * 0.9 + 0.05
    state = torch.randn(heads, dim, dim, generator=gen) * 0.3
    return q, k, v, slope, state


def _run(q, k, v, slope, states, slots, cu, context, block):
    return ops.lightning_attention_(q, k, v, slope, states, torch.tensor(slots), torch.tensor(cu, dtype=torch.int32),
                                    torch.tensor(context, dtype=torch.int32), block)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**16), tokens=st.integers(1, 20), heads=st.integers(1, 3), dim=st.sampled_from([2, 4]),
       block=st.sampled_from([1, 3, 8, 64]), continues=st.booleans())
def test_lightning_attention_matches_the_per_token_recurrence(seed, tokens, heads, dim, block, continues):
    q, k, v, slope, state = _inputs(seed, tokens, heads, dim)
    start = state if continues else torch.zeros_like(state)
    want, want_state = naive_lightning(q, k, v, slope, start)
    states = torch.stack([torch.full_like(state, 7.0), state])
    got = _run(q, k, v, slope, states, [1], [0, tokens], [5 if continues else 0], block)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(states[1], want_state, rtol=1e-4, atol=1e-4)
    assert torch.equal(states[0], torch.full_like(state, 7.0))  # another request's slot is untouched


def test_several_requests_in_one_step_with_a_padding_row():
    """Three rows (new, continuing, padding with slot −1) in one call: each row equals the
    recurrence from its own start, the padding row writes no slot."""
    q, k, v, slope, state = _inputs(3, 12, 2, 4)
    states = torch.stack([state, torch.zeros_like(state), state * 2])
    before = states.clone()
    got = _run(q, k, v, slope, states, [1, 2, -1], [0, 5, 6, 12], [0, 9, 0], 4)
    first, first_state = naive_lightning(q[:5], k[:5], v[:5], slope, torch.zeros_like(state))
    second, second_state = naive_lightning(q[5:6], k[5:6], v[5:6], slope, before[2])
    padding, _ = naive_lightning(q[6:], k[6:], v[6:], slope, torch.zeros_like(state))
    torch.testing.assert_close(got, torch.cat([first, second, padding]), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(states[1], first_state, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(states[2], second_state, rtol=1e-4, atol=1e-4)
    assert torch.equal(states[0], before[0])


def test_bad_block_size_and_shapes_are_refused_by_name():
    q, k, v, slope, state = _inputs(0, 4, 2, 4)
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        _run(q, k, v, slope, state[None].clone(), [0], [0, 4], [0], 0)
    with pytest.raises(ValueError, match=r"slope \(3,\) be \[heads\]"):
        _run(q, k, v, torch.ones(3), state[None].clone(), [0], [0, 4], [0], 4)


def _hf_module(layer_idx: int, heads: int = 2, block_size: int = 4) -> torch.nn.Module:
    config = transformers.MiniMaxConfig(hidden_size=16, num_attention_heads=heads, head_dim=4, num_hidden_layers=3,
                                        block_size=block_size, initializer_range=0.3)
    torch.manual_seed(layer_idx)
    module = hf.MiniMaxLightningAttention(config, layer_idx).eval()
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return module


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**16), layer_idx=st.integers(0, 2), prompt=st.integers(1, 11),
       chunks=st.lists(st.integers(1, 6), min_size=1, max_size=2), decode=st.integers(0, 3))
def test_layer_matches_hf_module_across_prefill_chunks_and_decode(seed, layer_idx, prompt, chunks, decode):
    """HF runs the prompt block-wise from an empty cache, then one token at a time from its linear
    cache; dcpgraph runs the prompt and any further tokens as varlen chunks carrying one slot. The
    decay depends on the layer index (HF's ``slope_rate``), so several layers are drawn."""
    module = _hf_module(layer_idx)
    assert is_lightning_attention(module)
    weights = canonical_weights(module)
    total = prompt + sum(chunks) + decode
    x = torch.randn(1, total, 16, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        cache = hf.MiniMaxCache()
        want = [module(x[:, :prompt], None, None, cache=cache)[0]]
        for t in range(prompt, total):
            want.append(module(x[:, t:t + 1], None, None, cache=cache)[0])
        want = torch.cat(want, dim=1)[0]
        states = torch.zeros(2, 2, 4, 4)
        pieces, done = [], 0
        for size in [prompt, *chunks, *([1] * decode)]:
            pieces.append(_layer(weights, x[0, done:done + size], states, done))
            done += size
    torch.testing.assert_close(torch.cat(pieces), want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(states[1], cache.linear_cache[layer_idx][0], rtol=1e-4, atol=1e-5)


def _layer(weights, hidden, states, context):
    return lightning_attention_layer(weights, hidden, states, torch.tensor([1]),
                                     torch.tensor([0, hidden.shape[0]], dtype=torch.int32),
                                     torch.tensor([context], dtype=torch.int32))


def test_an_unsupported_activation_is_refused_by_name():
    module = _hf_module(0)
    module.act_fn = torch.nn.GELU()
    with pytest.raises(Exception, match=r"qkv activation GELU is not supported; supported: silu"):
        canonical_weights(module)


def test_kv_state_bytes_formula_by_hand():
    """MiniMax-Text-01's lightning attention (H 64, D 128) at tp 8: 8·128·128·4 = 524,288 B per
    request per layer per rank, fp32 whatever the model dtype; tp 3 does not divide 64 heads."""
    from dcpgraph.errors import ConfigError
    from dcpgraph.recurrent_state import LightningAttentionShape

    shape = LightningAttentionShape(64, 128)
    assert shape.state_bytes_per_request(torch.bfloat16, 8) == 524_288
    assert shape.state_bytes_per_request(torch.bfloat16) == 8 * 524_288
    assert shape.on_rank(3) is shape and shape.kv_state_shape(2) == (2, 64, 128, 128)
    with pytest.raises(ConfigError, match="lightning attention head_dim must be a positive int, got 0"):
        LightningAttentionShape(4, 0)


@settings(max_examples=5, deadline=None)
@given(seed=st.integers(0, 2**16), first=st.integers(1, 9), second=st.integers(1, 9), chunk=st.integers(1, 6),
       layer_idx=st.integers(0, 2))
def test_layer_matches_hf_module_with_several_requests_in_one_step(seed, first, second, chunk, layer_idx):
    """Two requests of ``first + 3`` and ``second + 3`` tokens share every step with a padding row
    (slot −1): their prompts first (both new), then chunks of at most ``chunk`` tokens, until each
    is done; each request's rows equal HF's block-wise forward over its whole sequence, and the
    slots hold HF's final linear cache."""
    module = _hf_module(layer_idx)
    weights = canonical_weights(module)
    gen = torch.Generator().manual_seed(seed)
    xs = {2: torch.randn(first + 3, 16, generator=gen), 0: torch.randn(second + 3, 16, generator=gen)}
    with torch.no_grad():
        want, caches = {}, {}
        for slot, x in xs.items():
            caches[slot] = hf.MiniMaxCache()
            want[slot] = module(x[None], None, None, cache=caches[slot])[0][0]
        states = torch.full((3, 2, 4, 4), float("nan"))  # a new request must not read its slot's contents
        done, got = {2: 0, 0: 0}, {2: [], 0: []}
        sizes = {2: first, 0: second}
        pad = torch.randn(2, 16, generator=gen)
        while any(done[s] < len(xs[s]) for s in xs):
            rows = [(s, done[s], xs[s][done[s]:done[s] + sizes[s]]) for s in xs if done[s] < len(xs[s])]
            rows.append((-1, 0, pad))
            cu = [0]
            for _, _, x in rows:
                cu.append(cu[-1] + x.shape[0])
            out = lightning_attention_layer(weights, torch.cat([x for _, _, x in rows]), states,
                                            torch.tensor([s for s, _, _ in rows]), torch.tensor(cu, dtype=torch.int32),
                                            torch.tensor([c for _, c, _ in rows], dtype=torch.int32))
            for i, (slot, _, x) in enumerate(rows[:-1]):
                got[slot].append(out[cu[i]:cu[i + 1]])
                done[slot] += x.shape[0]
                sizes[slot] = chunk
    for slot in xs:
        torch.testing.assert_close(torch.cat(got[slot]), want[slot], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(states[slot], caches[slot].linear_cache[layer_idx][0], rtol=1e-4, atol=1e-5)
    assert torch.isnan(states[1]).all()  # the unused slot, and padding wrote nothing
