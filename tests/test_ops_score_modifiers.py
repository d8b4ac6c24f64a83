"""Sliding windows, logit soft-capping and attention sinks in the attention ops, against the
float64 dense reference (:func:`dcpgraph.testing.reference.dense_attention`, which writes each
modifier the way the models do: ``c·tanh(s/c)``, a position mask, an extra softmax column).

The DCP test replays, op by op, the dataflow ``insert_kv_cache`` + ``shard_dcp`` emit for one
layer: every rank reads its local context shard with ``kv_start = local_len(max(p − W + 1, 0), r)``
(:mod:`dcpgraph.layout`), the context partials merge over the group by either comm (a2a:
``merge_attention`` of all ranks' partials; ag_rs: ``rescale_to_global`` per rank, then a sum), and
the final merge takes the new-token part and the sink partial ``(0, sink)`` once. Requests with an
empty context, ranks with an empty shard and windows that exclude a whole shard are all drawn.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, note, settings
from hypothesis import strategies as st

import dcpgraph.ops  # noqa: F401  (registers torch.ops.dcpgraph.*)
from dcpgraph import layout
from dcpgraph.testing import strategies as dst
from dcpgraph.testing.reference import dense_attention

ops = torch.ops.dcpgraph
NEG_INF = float("-inf")


def _randn(gen, *shape):
    return torch.randn(*shape, generator=gen, dtype=torch.float64)


def _cu(counts):
    return torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)


def _write_contexts(ks, vs, ctx, dcp, interleave, block):
    """Per-rank paged caches holding each request's first ``ctx[i]`` tokens, written through
    ``layout.slot_mapping``; unwritten slots hold NaN so a read outside a shard shows up."""
    virtual = block * dcp
    widths = [max(-(-n // virtual), 1) for n in ctx]
    table = torch.zeros(len(ctx), max(widths), dtype=torch.int32)
    used = 0
    for i, w in enumerate(widths):
        table[i, :w] = torch.arange(used, used + w, dtype=torch.int32)
        used += w
    hkv, d, dv = ks[0].shape[1], ks[0].shape[2], vs[0].shape[2]
    k_caches = [torch.full((used, block, hkv, d), math.nan, dtype=torch.float64) for _ in range(dcp)]
    v_caches = [torch.full((used, block, hkv, dv), math.nan, dtype=torch.float64) for _ in range(dcp)]
    pos = torch.cat([torch.arange(n) for n in ctx])
    rows = torch.cat([table[i].expand(n, -1) for i, n in enumerate(ctx)])
    k_ctx = torch.cat([k[:n] for k, n in zip(ks, ctx)])
    v_ctx = torch.cat([v[:n] for v, n in zip(vs, ctx)])
    for r in range(dcp):
        slots = layout.slot_mapping(pos, rows, r, dcp, block, interleave)
        ops.kv_cache_write_(k_caches[r], k_ctx, slots)
        ops.kv_cache_write_(v_caches[r], v_ctx, slots)
    return k_caches, v_caches, table


def _dcp_layer(q, ks, vs, ctx, new, scale, *, dcp, interleave, block, window, softcap, sinks, comm):
    """One layer's cached attention as the compiled DCP graph computes it (see module docstring)."""
    k_caches, v_caches, table = _write_contexts(ks, vs, ctx, dcp, interleave, block)
    cu = _cu(new)
    positions = torch.cat([torch.arange(c, c + n) for c, n in zip(ctx, new)])
    extra = lambda start: (start, softcap) if (window or softcap) else ()  # noqa: E731
    outs, lses = [], []
    for r in range(dcp):
        lens = torch.tensor([layout.local_len(c, r, dcp, interleave) for c in ctx], dtype=torch.int32)
        start = layout.local_len((positions - window + 1).clamp_min(0), r, dcp, interleave) if window else None
        o, lse = ops.paged_attention(q, k_caches[r], v_caches[r], table, cu, lens, None, scale, *extra(start))
        assert not torch.isnan(o).any(), f"rank {r} read a slot outside its shard"
        outs.append(o)
        lses.append(lse)
    if comm == "a2a":
        o_ctx, lse_ctx = ops.merge_attention(torch.stack(outs), torch.stack(lses))
    else:
        all_lses = torch.stack(lses)
        shares = [ops.rescale_to_global(o, lse, all_lses) for o, lse in zip(outs, lses)]
        o_ctx, lse_ctx = sum(s[0] for s in shares), shares[0][1]
    k_new = torch.cat([k[c : c + n] for k, c, n in zip(ks, ctx, new)])
    v_new = torch.cat([v[c : c + n] for v, c, n in zip(vs, ctx, new)])
    partial_extra = (window, softcap) if (window or softcap) else ()
    o_new, lse_new = ops.partial_attention(q, k_new, v_new, cu, cu, scale, True, *partial_extra)
    parts_o, parts_l = [o_ctx.to(q.dtype), o_new], [lse_ctx, lse_new]
    if sinks is not None:
        parts_o.append(torch.zeros_like(o_new))
        parts_l.append(torch.zeros_like(lse_new) + sinks.to(lse_new.dtype))
    return ops.merge_attention(torch.stack(parts_o), torch.stack(parts_l))


def _dense(q, ks, vs, ctx, new, scale, window, softcap, sinks):
    outs, lses, t0 = [], [], 0
    for k, v, c, n in zip(ks, vs, ctx, new):
        o, lse = dense_attention(q[t0 : t0 + n], k[: c + n], v[: c + n], scale, q_positions=torch.arange(c, c + n),
                                 window=window, softcap=softcap, sinks=sinks)
        outs.append(o)
        lses.append(lse)
        t0 += n
    return torch.cat(outs), torch.cat(lses)


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    seed=dst.seeds(),
    dcp=dst.dcp_sizes(1, 5),
    interleave=dst.interleaves((1, 2, 4)),
    comm=st.sampled_from(("a2a", "ag_rs")),
    window=st.sampled_from((0, 1, 2, 5, 13)),
    softcap=st.sampled_from((0.0, 0.7, 4.0)),
    use_sinks=st.booleans(),
)
def test_dcp_layer_with_modifiers_equals_dense(data, seed, dcp, interleave, comm, window, softcap, use_sinks):
    block = data.draw(dst.block_sizes(interleave, max_multiple=3))
    requests = data.draw(st.integers(1, 3))
    ctx = [data.draw(dst.lengths(dcp, interleave, max_value=40)) for _ in range(requests)]
    new = [data.draw(st.integers(1, 4)) for _ in range(requests)]
    hkv, group, d = data.draw(st.sampled_from(((1, 4, 8), (2, 2, 6), (2, 1, 4))))
    note(f"{dcp=} {interleave=} {block=} {ctx=} {new=} {window=} {softcap=} {use_sinks=} {comm=}")
    gen = torch.Generator().manual_seed(seed)
    q = _randn(gen, sum(new), hkv * group, d)
    ks = [_randn(gen, c + n, hkv, d) for c, n in zip(ctx, new)]
    vs = [_randn(gen, c + n, hkv, d) for c, n in zip(ctx, new)]
    sinks = 2 * _randn(gen, hkv * group) if use_sinks else None
    scale = d ** -0.5 * 3  # large scores, so the cap and the window change the result
    out, lse = _dcp_layer(q, ks, vs, ctx, new, scale, dcp=dcp, interleave=interleave, block=block,
                          window=window, softcap=softcap, sinks=sinks, comm=comm)
    ref_out, ref_lse = _dense(q, ks, vs, ctx, new, scale, window, softcap, sinks)
    torch.testing.assert_close(out, ref_out, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(lse, ref_lse, atol=1e-10, rtol=1e-10)


def test_a_sink_applied_on_every_rank_is_wrong():
    """The property the sink partial protects: adding the sink to each rank's partial before the
    DCP merge counts it ``dcp`` times, which differs from the dense result; once is exact."""
    gen = torch.Generator().manual_seed(3)
    dcp, ctx = 4, 12
    q, k, v = _randn(gen, 1, 2, 8), _randn(gen, ctx, 2, 8), _randn(gen, ctx, 2, 8)
    sinks = torch.tensor([1.5, -0.5], dtype=torch.float64)
    ref, _ = dense_attention(q, k, v, 0.4, q_positions=torch.tensor([ctx - 1]), sinks=sinks)
    t = torch.arange(ctx)
    outs, lses = [], []
    for r in range(dcp):
        mine = layout.owner(t, dcp) == r
        o, lse = dense_attention(q, k[mine], v[mine], 0.4)
        outs.append(o)
        lses.append(lse)
    sink_o, sink_l = torch.zeros_like(outs[0]), sinks.view(1, -1).to(lses[0].dtype)
    once, _ = ops.merge_attention(torch.stack([*outs, sink_o]), torch.stack([*lses, sink_l]))
    per_rank = [ops.merge_attention(torch.stack([o, sink_o]), torch.stack([lse, sink_l])) for o, lse in zip(outs, lses)]
    merged_twice, _ = ops.merge_attention(torch.stack([p[0] for p in per_rank]), torch.stack([p[1] for p in per_rank]))
    torch.testing.assert_close(once, ref, atol=1e-12, rtol=0)
    assert (merged_twice - ref).abs().max() > 1e-3


@pytest.mark.parametrize("softcap", [0.0, 1.0])
@pytest.mark.parametrize("window", [0, 3])
def test_canonical_attention_op_with_modifiers_equals_dense(window, softcap):
    gen = torch.Generator().manual_seed(5)
    b, hq, hkv, s, d = 2, 4, 2, 9, 8
    q, k, v = _randn(gen, b, hq, s, d), _randn(gen, b, hkv, s, d), _randn(gen, b, hkv, s, d)
    sinks = _randn(gen, hq)
    out = ops.attention(q, k, v, 0.8, True, window, softcap, sinks)
    for i in range(b):
        ref, _ = dense_attention(q[i].transpose(0, 1), k[i].transpose(0, 1), v[i].transpose(0, 1), 0.8,
                                 q_positions=torch.arange(s), window=window, softcap=softcap, sinks=sinks)
        torch.testing.assert_close(out[i].transpose(0, 1), ref, atol=1e-12, rtol=0)


def test_native_kernel_is_never_asked_for_a_window_or_a_cap(monkeypatch):
    """fp32 paged decode with a window start or a soft-cap takes the torch path (the native kernel
    knows neither), and still matches the dense reference."""
    from dcpgraph.ops import native

    def refuse(*args, **kwargs):
        raise AssertionError("native kernel called with a window or soft-cap")

    monkeypatch.setattr(native, "native_paged_decode", refuse)
    gen = torch.Generator().manual_seed(9)
    ctx = [7, 0, 11]
    ks = [_randn(gen, c + 1, 1, 8) for c in ctx]
    vs = [_randn(gen, c + 1, 1, 8) for c in ctx]
    q = _randn(gen, 3, 2, 8)
    k_caches, v_caches, table = _write_contexts(ks, vs, ctx, 1, 1, 4)
    pos = torch.tensor(ctx)
    start = (pos - 4 + 1).clamp_min(0)
    o, _ = ops.paged_attention(q.float(), k_caches[0].float(), v_caches[0].float(), table, _cu([1, 1, 1]),
                               torch.tensor(ctx, dtype=torch.int32), None, 0.5, start, 2.0)
    for i, c in enumerate(ctx):
        ref, _ = dense_attention(q[i : i + 1], ks[i][:c], vs[i][:c], 0.5, q_positions=torch.tensor([c]),
                                 window=4, softcap=2.0)
        torch.testing.assert_close(o[i : i + 1].double(), ref, atol=1e-5, rtol=1e-5)


@settings(max_examples=40, deadline=None)
@given(dcp=dst.dcp_sizes(1, 8), interleave=dst.interleaves((1, 2, 4, 16)), data=st.data())
def test_window_start_emitted_by_shard_dcp_equals_layout_local_len(dcp, interleave, data):
    """The graph ops ``shard_dcp`` emits for a rank's local window start compute exactly
    ``layout.local_len`` of the global start, on every rank."""
    import torch.fx

    from dcpgraph.passes.graph_edit import Emitter
    from dcpgraph.passes.shard_dcp import _emit_local_len

    graph = torch.fx.Graph()
    start, rank = graph.placeholder("start"), graph.placeholder("dcp_rank")
    graph.output(_emit_local_len(Emitter(graph), start, rank, dcp, interleave))
    fn = torch.fx.GraphModule(torch.nn.Module(), graph)
    starts = torch.tensor(data.draw(st.lists(dst.lengths(dcp, interleave, max_value=500), min_size=1, max_size=8)))
    for r in range(dcp):
        got = fn(starts, torch.tensor(r))
        assert torch.equal(got, layout.local_len(starts, r, dcp, interleave)), (r, starts)
