"""DeepSeek-V4 through ``dcpgraph.compile`` (dcp=1; tp=1, and tp=2 and 4 over four output groups): the cached forms of the compressed ops
over paged caches and open-window slots against the canonical ops on whole sequences (default
tier), and the compiled engine's greedy tokens against HF ``generate`` on the tiny model of
``tests/dsv4_models.py`` through chunked prefill and a preemption (slow tier: the export takes
30-70 s here)."""

from __future__ import annotations

import dsv4_models
import pytest
import torch

import dcpgraph
from dcpgraph.ops import compressed_cached  # noqa: F401  (registers the cached forms)

DCP = torch.ops.dcpgraph
BLOCK = 4
_steps = dsv4_models.chunk_steps


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("cuts", [(1,), (3, 1, 5), (7, 2)])
def test_cached_ops_over_steps_equal_the_canonical_ops_on_whole_sequences(overlap, cuts):
    """Two requests (14 and 9 tokens, rate 3, window 4, top-2) fed in chunks that cross window and
    entry boundaries, both in every step: the compressor's row-form output, the selection and the
    attention equal the canonical ops run on each whole sequence. The canonical ops are checked
    against HF in ``test_frontend_compressed``."""
    gen = torch.Generator().manual_seed(3)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    rate, window, topk, heads, dim, idim = 3, 4, 2, 2, 8, 4
    width = 2 * dim if overlap else dim  # the compressor's entries are the attention's (D = dim)
    lengths = (14, 9)
    seqs = [dict(kv=r(n, width), gate=r(n, width), q=r(heads, n, dim), raw=r(n, dim), iq=r(n, 2, idim),
                 w=r(n, 2), keys=r(n, idim)) for n in lengths]
    bias = r(rate, width)
    sinks = r(heads)
    want = []
    for s, n in zip(seqs, lengths):
        pos = torch.arange(n).unsqueeze(0)
        rows = DCP.compress_windows(s["kv"][None], s["gate"][None], bias, rate, overlap)
        entries = rows
        sel = DCP.compressed_topk(s["iq"][None], s["w"][None], s["keys"][None], pos, 0.5, rate, topk)
        out = DCP.compressed_attention(s["q"][None], s["raw"][None, None], entries, pos, sinks, 0.3, window, rate, sel)
        want.append((rows[0], sel[0], out[0], entries[0]))
    blocks_per = 4  # 16 slots per request: its 14 tokens and its entries
    table = torch.arange(2 * blocks_per).view(2, blocks_per).flip(0)  # request 0 on the later blocks
    kv_cache = torch.zeros(2 * blocks_per, BLOCK, 1, dim, dtype=torch.float64)
    rows_per_block = -(-BLOCK // rate)  # entry w in the block of its first token w·m
    entry_cache = torch.zeros(2 * blocks_per, rows_per_block, 1, dim, dtype=torch.float64)
    index_cache = torch.zeros(2 * blocks_per, rows_per_block, 1, idim, dtype=torch.float64)
    pool = torch.zeros(3, (2 if overlap else 1) * rate, 2 * width, dtype=torch.float64)
    slots = torch.tensor([2, 0])
    got = [([], [], []) for _ in lengths]
    for step in _steps(lengths, cuts):
        def cat(key, dim_=0, step=step):
            return torch.cat([seqs[q][key].narrow(dim_, a, b - a) for q, a, b in step], dim_)

        rows_ = [q for q, _, _ in step]
        cu = torch.tensor([0, *torch.tensor([b - a for _, a, b in step]).cumsum(0).tolist()])
        ctx = torch.tensor([a for _, a, _ in step])
        pos = torch.cat([torch.arange(a, b) for _, a, b in step]).unsqueeze(0)
        table_, slots_ = table[rows_], slots[rows_]
        rows = DCP.compress_windows_(cat("kv")[None], cat("gate")[None], bias, pool, slots_, cu, ctx, rate, overlap)
        ent = torch.cat([want[q][3][a:b] for q, a, b in step])[None]  # the canonical entries, row form
        sel = DCP.compressed_topk_(cat("iq")[None], cat("w")[None], cat("keys")[None], pos, index_cache, table_, cu,
                                   ctx, 0.5, rate, topk, BLOCK)
        out = DCP.compressed_attention_(cat("q", 1)[None], cat("raw")[None, None], ent, pos, sinks, kv_cache,
                                        entry_cache, table_, table_, cu, ctx, 0.3, window, rate, sel, BLOCK)
        for i, (q, _, _) in enumerate(step):
            a, b = int(cu[i]), int(cu[i + 1])
            got[q][0].append(rows[0, a:b])
            got[q][1].append(sel[0, a:b])
            got[q][2].append(out[0, :, a:b])
    for (rows, sel, out, _), (g_rows, g_sel, g_out) in zip(want, got):
        torch.testing.assert_close(torch.cat(g_rows), rows, atol=1e-12, rtol=1e-12)
        assert torch.equal(torch.cat(g_sel), sel)
        torch.testing.assert_close(torch.cat(g_out, 1), out, atol=1e-12, rtol=1e-12)


@pytest.fixture(scope="module")
def traced():
    model = dsv4_models.build()
    return model, dcpgraph.trace(model)


PROMPTS = [list(dsv4_models.PROMPTS[3]), [5, 9, 3, 17, 22, 40, 8, 1, 33, 12, 60], [1, 2, 3], [7]]
NEW_TOKENS = 8


@pytest.mark.slow  # the V4 export (~30 s, once per module) and ~15 s per engine run on 2 loaded cores
@pytest.mark.parametrize("hybrid_kv_cache", [False, True])
def test_compiled_v4_gives_hf_greedy_tokens_through_chunks_and_a_preemption(traced, hybrid_kv_cache):
    """Four prompts (1-23 tokens, window 6, entries of 2 and 4 tokens, top-3 of up to 7 entries),
    5-token prefill chunks crossing window and entry boundaries, and 10 blocks of 4 (too few for
    all four, so one is preempted and recomputed from an empty open window): the compiled
    engine's greedy tokens are HF ``generate``'s, every state slot comes back, and the lowered
    program holds the cached ops only. With ``hybrid_kv_cache`` the compressed layers' raw rows
    live in the sliding group's pool, whose blocks before the window are returned."""
    from dcpgraph.testing.generation import drain, hf_greedy

    model, program = traced
    want = [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]
    engine = dcpgraph.compile(program, block_size=BLOCK, max_num_batched_tokens=5, num_blocks=10,
                              hybrid_kv_cache=hybrid_kv_cache)
    for prompt in PROMPTS:
        engine.add_request(prompt, max_new_tokens=NEW_TOKENS)
    got = drain(engine)
    assert [got[i] for i in range(len(PROMPTS))] == want
    assert engine.scheduler.stats["preemptions"] >= 1
    assert sorted(engine.scheduler.state_slots.free) == list(range(engine.program.lowering.state_slots))
    lowered = engine.program
    targets = {n.target for n in lowered.graph_module.graph.nodes if n.op == "call_function"}
    assert not targets & {DCP.compress_windows.default, DCP.compressed_topk.default, DCP.compressed_attention.default}
    assert {DCP.compress_windows_.default, DCP.compressed_topk_.default, DCP.compressed_attention_.default} <= targets
    assert sorted(p.name for p in lowered.recurrent_states) == [
        "index_open_window_2", "open_window_1", "open_window_2", "open_window_3"]
    assert {c.name: c.dim for c in lowered.caches if c.layer} == {
        "compressed_kv_1": 32, "entries_1": 32, "compressed_kv_2": 32, "entries_2": 32, "index_entries_2": 16,
        "compressed_kv_3": 32, "entries_3": 32}
    sliding = set(lowered.lowering.sliding_caches)
    assert sliding == ({"k_cache_0", "v_cache_0", "compressed_kv_1", "compressed_kv_2", "compressed_kv_3"}
                       if hybrid_kv_cache else set())
    _check_bytes(engine, model.config, hybrid_kv_cache)
    # P/D: exportable in one process (the hand-over itself: tests/test_compressed_pd.py); with
    # hybrid_kv_cache refused by name before anything moves
    from dcpgraph.errors import RequestError
    from dcpgraph.runtime.kv_transfer import check_exportable

    if hybrid_kv_cache:
        with pytest.raises(RequestError, match=r"hybrid_kv_cache=True"):
            check_exportable(engine)
    else:
        check_exportable(engine)


@pytest.fixture(scope="module")
def traced_four_groups():
    return dsv4_models.traced(o_groups=4)  # shared with test_compile_compressed_dcp


@pytest.mark.slow  # a second V4 export (~25 s) and 8-40 s per mesh of emulated ranks on 2 loaded cores
@pytest.mark.parametrize("tp", [2, 4])
def test_compiled_v4_at_tp_gives_hf_greedy_tokens(traced_four_groups, tp):
    """4 query heads and 4 output groups over tp ranks (tp=2: two heads and two groups per rank;
    tp=4: one of each; the K=V head, compressor and indexer replicated): the same prompts, chunks
    and preemption as at tp=1 give HF ``generate``'s greedy tokens, and every rank holds the whole
    single-head caches."""
    from dcpgraph.testing.generation import drain, hf_greedy

    model, program = traced_four_groups
    want = [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]
    engine = dcpgraph.compile(program, tp=tp, block_size=BLOCK, max_num_batched_tokens=5, num_blocks=10)
    for prompt in PROMPTS:
        engine.add_request(prompt, max_new_tokens=NEW_TOKENS)
    got = drain(engine)
    assert [got[i] for i in range(len(PROMPTS))] == want
    assert engine.scheduler.stats["preemptions"] >= 1
    assert {c.name: (c.heads, c.dim) for c in engine.program.caches if c.layer} == {
        **{f"{kind}_{i}": (1, 32) for i in (1, 2, 3) for kind in ("compressed_kv", "entries")},
        "index_entries_2": (1, 16)}


def _check_bytes(engine, config, hybrid_kv_cache):
    """Per rank: the entries and indexer keys cost the planner's bytes per token
    (``compressed_cache_bytes(...).per_token``, ``Σ (D·b + Di·bi)/m``: the rates 2 and 4 divide
    the block of 4); the raw rows one row per token, in the sliding group under ``hybrid_kv_cache``."""
    from fractions import Fraction

    from dcpgraph.plan.compressed_cache import compressed_cache_bytes

    report = engine.memory_report()
    per_token = compressed_cache_bytes(config, context_tokens=64, element_bytes=8).per_token
    by_layer = report["kv_bytes_per_block_by_layer"]
    dim = config.head_dim
    raw = sum(BLOCK * dim * 8 for _ in (1, 2, 3))
    assert Fraction(sum(by_layer[i] for i in (1, 2, 3)) - raw, BLOCK) == per_token
    if hybrid_kv_cache:  # the full group is exactly the entries and indexer keys
        full = report["kv_layer_groups"]["full"]
        assert Fraction(full["bytes_per_rank"], full["num_blocks"] * BLOCK) == per_token
