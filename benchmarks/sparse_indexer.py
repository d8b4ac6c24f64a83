"""DSA indexer time per decode step against dcp: the sharded indexer vs a replicated one.

Per decode step and layer, one query scores its context with DeepSeek-V3.2's lightning indexer
(64 heads of 128, ``index_topk`` 2048) and keeps the top 2048. With dcpgraph's sharded indexer a
rank of a DCP group of ``N`` scores only its ``ctx/N`` local keys (``paged_indexer_topk`` over its
local paged index cache), then ``merge_topk`` picks the global top-k from the ``N·k`` gathered
candidates; vLLM Ascend's replicated indexer scores all ``ctx`` keys on every rank whatever ``N``
(measured here as the dcp=1 row: the same op over the whole context). The collective between the
two (an all-gather of ``N·k`` scores and positions, independent of the context length) is not
timed: this is a single-process kernel measurement on one rank's shard.

Reported per (context, dcp): the rank-local indexer time, the merge time, their sum as a ratio to
dcp=1, and the per-rank index-cache bytes (bf16 keys of 128). Variants are interleaved rep by rep.
"""

from __future__ import annotations

import argparse
import statistics
import time

import common
import torch

from dcpgraph import layout
from dcpgraph.ops import sparse  # noqa: F401  (registers the ops)

NAME = "sparse_indexer"
HEADS, DIM, TOPK, BLOCK = 64, 128, 2048, 128
FULL_CONTEXTS, QUICK_CONTEXTS = (16384, 65536, 131072), (8192, 32768)
DCPS = (1, 2, 4, 8)
ops = torch.ops.dcpgraph


def _rank_inputs(ctx: int, dcp: int, gen: torch.Generator):
    """Rank 0's local index cache (paged, contiguous blocks) and one decode query."""
    local = int(layout.local_len(ctx, 0, dcp, 1))
    blocks = -(-local // BLOCK)
    cache = torch.randn(blocks, BLOCK, 1, DIM, generator=gen)
    q = torch.randn(1, HEADS, DIM, generator=gen)
    w = torch.randn(1, HEADS, generator=gen)
    table = torch.arange(blocks).unsqueeze(0)
    return q, w, cache, table, torch.tensor([0, 1]), torch.tensor([local]), local


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--reps", type=int, default=None)
    args = parser.parse_args(argv)
    contexts = QUICK_CONTEXTS if args.quick else FULL_CONTEXTS
    reps = args.reps or (3 if args.quick else 7)
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    load = common.load_note()
    records, start = [], time.perf_counter()
    print(f"indexer {HEADS}x{DIM}, topk {TOPK}, fp32 scores, 1 thread ({load})")
    print(f"{'context':>8} {'dcp':>4} {'local keys':>10} {'indexer':>10} {'merge':>8} {'total':>10} {'vs dcp1':>8}")
    for ctx in contexts:
        inputs = {d: _rank_inputs(ctx, d, gen) for d in DCPS}
        candidates = {}
        for d in DCPS:
            q, w, cache, table, cu, bound, _ = inputs[d]
            vals, idx = ops.paged_indexer_topk(q, w, cache, table, cu, bound, DIM ** -0.5, TOPK)
            candidates[d] = (vals.expand(d, -1, -1).contiguous(), idx.expand(d, -1, -1).contiguous())
        fns = {}
        for d in DCPS:
            q, w, cache, table, cu, bound, _ = inputs[d]
            fns[f"index{d}"] = (lambda q=q, w=w, c=cache, t=table, cu=cu, b=bound:
                                ops.paged_indexer_topk(q, w, c, t, cu, b, DIM ** -0.5, TOPK))
            fns[f"merge{d}"] = lambda v=candidates[d][0], p=candidates[d][1]: ops.merge_topk(v, p, TOPK)
        times = common.interleaved(fns, reps)
        base = None
        for d in DCPS:
            index_ms = statistics.median(times[f"index{d}"]) * 1e3
            merge_ms = statistics.median(times[f"merge{d}"]) * 1e3 if d > 1 else 0.0
            total = index_ms + merge_ms
            base = total if d == 1 else base
            local = inputs[d][-1]
            config = f"dsa indexer h={HEADS} d={DIM} topk={TOPK} ctx={ctx} dcp={d} local_keys={local} {load}"
            extra = {} if d == 1 else {"baseline": base}
            records.append(common.record(NAME, config, "indexer_time", index_ms, "ms", digits=4))
            records.append(common.record(NAME, config, "topk_merge_time", merge_ms, "ms", digits=4))
            records.append(common.record(NAME, config, "indexer_step_time", total, "ms", digits=4, **extra))
            records.append(common.record(NAME, config, "index_cache_bytes_per_rank", local * DIM * 2, "B"))
            print(f"{ctx:>8} {d:>4} {local:>10} {index_ms:>8.2f}ms {merge_ms:>6.2f}ms {total:>8.2f}ms "
                  f"{total / base:>8.2f}")
    out = common.write(NAME, records)
    print(f"wrote {out} in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
