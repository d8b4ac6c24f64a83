"""DeepSeek-V4's cached compressed ops at dcp > 1 (:mod:`dcpgraph.ops.compressed_dcp`): ``N``
emulated ranks, each with its own paged caches, the group's collectives done by hand (the
candidates' gather and ``merge_topk``, the partials stacked for the merge), over chunked steps of
two requests, against the canonical one-rank ops on each whole sequence (themselves checked
against dense formulas and HF in ``test_compressed_attention`` / ``test_frontend_compressed``)."""

from __future__ import annotations

import dsv4_models
import pytest
import torch

from dcpgraph.ops import compressed_dcp  # noqa: F401  (registers the DCP forms)
from dcpgraph.passes.insert_compressed_cache import entry_tokens_per_row

DCP = torch.ops.dcpgraph
BLOCK = 4
_steps = dsv4_models.chunk_steps


@pytest.mark.parametrize("dcp,interleave,rate", [(2, 1, 2), (2, 2, 3), (3, 1, 2), (4, 4, 2)])
@pytest.mark.parametrize("cuts", [(3, 1, 5)])
def test_dcp_cached_ops_over_steps_equal_the_canonical_ops(dcp, interleave, rate, cuts):
    """Two requests (14 and 9 tokens, window 4, top-2 of up to 7 entries) in chunks crossing window
    and entry boundaries: every rank's selection (the merged local top-k) equals the dense
    selection, and the LSE merge of the ranks' partials with the sink joined once equals the
    canonical attention; each entry is stored on exactly one rank."""
    gen = torch.Generator().manual_seed(5)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    window, topk, heads, dim, idim = 4, 2, 2, 8, 4
    lengths = (14, 9)
    seqs = [dict(q=r(heads, n, dim), raw=r(n, dim), iq=r(n, 2, idim), w=r(n, 2), keys=r(n, idim), ent=r(n, dim))
            for n in lengths]
    sinks = r(heads)
    want = []
    for s, n in zip(seqs, lengths):
        pos = torch.arange(n).unsqueeze(0)
        sel = DCP.compressed_topk(s["iq"][None], s["w"][None], s["keys"][None], pos, 0.5, rate, topk)
        out = DCP.compressed_attention(s["q"][None], s["raw"][None, None], s["ent"][None], pos, sinks, 0.3, window,
                                       rate, sel)
        want.append((sel[0], out[0]))
    rows = BLOCK // entry_tokens_per_row(rate, BLOCK, dcp, interleave)
    assert rows % interleave == 0 and rows * rate >= BLOCK
    cols = 4  # virtual blocks per request (of BLOCK·dcp tokens): more than 14 tokens need
    table = torch.arange(2 * cols).view(2, cols).flip(0)
    caches = [dict(kv=torch.zeros(2 * cols, BLOCK, 1, dim, dtype=torch.float64),
                   ent=torch.zeros(2 * cols, rows, 1, dim, dtype=torch.float64),
                   idx=torch.zeros(2 * cols, rows, 1, idim, dtype=torch.float64)) for _ in range(dcp)]
    got = [([], []) for _ in lengths]
    for step in _steps(lengths, cuts):
        def cat(key, dim_=0, step=step):
            return torch.cat([seqs[q][key].narrow(dim_, a, b - a) for q, a, b in step], dim_)

        reqs = [q for q, _, _ in step]
        cu = torch.tensor([0, *torch.tensor([b - a for _, a, b in step]).cumsum(0).tolist()])
        ctx = torch.tensor([a for _, a, _ in step])
        pos = torch.cat([torch.arange(a, b) for _, a, b in step]).unsqueeze(0)
        table_ = table[reqs]
        cands = [DCP.compressed_topk_dcp_(cat("iq")[None], cat("w")[None], cat("keys")[None], pos, c["idx"], table_,
                                          cu, ctx, torch.tensor(k), 0.5, rate, topk, dcp, interleave)
                 for k, c in enumerate(caches)]
        sel = DCP.merge_topk(torch.cat([v for v, _ in cands]), torch.cat([g for _, g in cands]), topk)[None]
        partials = [DCP.compressed_attention_dcp_(cat("q", 1), cat("raw")[None, None], cat("ent")[None], pos,
                                                  c["kv"], c["ent"], table_, table_, cu, ctx, torch.tensor(k), 0.3,
                                                  window, rate, sel, dcp, interleave)
                    for k, c in enumerate(caches)]
        out = DCP.compressed_merge_sinks(torch.stack([o for o, _ in partials]), torch.stack([s for _, s in partials]),
                                         sinks)
        for i, (q, _, _) in enumerate(step):
            a, b = int(cu[i]), int(cu[i + 1])
            got[q][0].append(sel[0, a:b])
            got[q][1].append(out[0, :, a:b])
    for (sel, out), (g_sel, g_out) in zip(want, got):
        assert torch.equal(torch.cat(g_sel), sel)
        torch.testing.assert_close(torch.cat(g_out, 1), out, atol=1e-12, rtol=1e-12)
    stored = sum(int((c["ent"].abs().sum(-1) > 0).sum()) for c in caches)
    assert stored == sum(n // rate for n in lengths)  # each entry on exactly one rank


def test_entry_rows_at_dcp_are_a_multiple_of_the_interleave_or_refused():
    from dcpgraph.errors import ConfigError

    assert entry_tokens_per_row(4, 16, 1, 1) == 4
    assert entry_tokens_per_row(4, 16, 2, 1) == 4  # 4 rows per block
    assert entry_tokens_per_row(4, 16, 2, 8) == 2  # 8 rows: runs of 8 entries fit a block
    assert entry_tokens_per_row(128, 16, 4, 16) == 1
    with pytest.raises(ConfigError, match="must divide block_size=12"):
        entry_tokens_per_row(2, 12, 2, 4)  # 6 rows -> 8, which does not divide 12
