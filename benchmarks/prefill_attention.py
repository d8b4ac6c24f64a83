"""A chunked prefill's context attention: the native kernel's bounded rows vs a gathered copy.

Chunked prefill writes a chunk's tokens into the paged cache and then attends each of its ``C``
query tokens over the request's cached keys up to itself (``kv_bound``: token ``t`` of the chunk
sees keys ``j < ctx - C + t + 1``). The torch path (what ``paged_attention`` ran for such rows
before the AMX kernel took bounds) gathers the request's blocks into a contiguous copy and runs
dense attention with a mask; the native path reads the blocks in place through the block table,
64 query rows at a time over the keys any of them sees (:mod:`dcpgraph.ops.native`).

For a bf16 model (bf16 queries, bf16 or fp8 cache), one request, GQA 8:1 (one KV head of 128),
chunks of ``C`` = 256 and 1,024 tokens ending at ``ctx`` = 8K and 32K tokens, scattered blocks of
16: the op's time per call on both paths (1 thread, process CPU time, variants interleaved, best
of ``--reps``) and their ratio, checked against each other first (the AMX path's stated
tolerance). No target: this measures the "no gathered copy" claim.

    python3 benchmarks/prefill_attention.py [--reps N]
"""

from __future__ import annotations

import argparse
import time

import common
import torch
from attention_bandwidth import KV_DTYPES

import dcpgraph.ops.library  # noqa: F401  (registers torch.ops.dcpgraph)
from dcpgraph.ops import native, paged, quant

NAME = "prefill_attention"
BLOCK, HQ, HKV, D = 16, 8, 1, 128
CASES = [(ctx, chunk) for ctx in (8192, 32768) for chunk in (256, 1024)]


def run_case(ctx: int, chunk: int, kv_name: str, reps: int) -> list[dict]:
    kv_dtype = KV_DTYPES[kv_name]
    gen = torch.Generator().manual_seed(0)
    nb = ctx // BLOCK
    k, ks, _ = paged._stored_as(torch.randn(nb, BLOCK, HKV, D, generator=gen), kv_dtype)
    v, vs, _ = paged._stored_as(torch.randn(nb, BLOCK, HKV, D, generator=gen), kv_dtype)
    table = torch.randperm(nb, generator=gen).to(torch.int32).view(1, nb)
    q = torch.randn(chunk, HQ, D, generator=gen).to(torch.bfloat16)
    cu = torch.tensor([0, chunk], dtype=torch.int32)
    lens = torch.tensor([ctx], dtype=torch.int32)
    bound = torch.arange(ctx - chunk + 1, ctx + 1, dtype=torch.int32)
    scale = D ** -0.5

    def torch_path():
        kc, vc, t = (quant.dequantized_context(k, v, ks, vs, table, lens, q.dtype) if ks is not None
                     else (k, v, table))
        return paged._paged_partial_attention_torch(q, kc, vc, t, cu, lens, bound, scale)

    def native_path():
        return paged.paged_partial_attention(q, k, v, table, cu, lens, bound, scale, k_scales=ks, v_scales=vs)

    got, want = native_path(), torch_path()
    torch.testing.assert_close(got[0].float(), want[0].float(), atol=native.AMX_OUT_TOL, rtol=native.AMX_OUT_TOL)
    best = {"native": float("inf"), "torch": float("inf")}
    for _ in range(reps):
        for name, fn in (("native", native_path), ("torch", torch_path)):
            start = time.process_time()
            fn()
            best[name] = min(best[name], time.process_time() - start)
    config = (f"gqa 8:1 d={D} ctx={ctx} chunk={chunk} {kv_name} q=bf16 block={BLOCK} threads=1 clock=cpu "
              f"min-of-{reps} {common.load_note()}")
    return [
        common.record(NAME, config, "torch_gather_ms", best["torch"] * 1e3, "ms"),
        common.record(NAME, config, "native_bounded_ms", best["native"] * 1e3, "ms"),
        common.record(NAME, config, "speedup", best["torch"] / best["native"], "x"),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    torch.set_num_threads(1)
    if not native.available() or not native.amx_enabled(torch.bfloat16):
        print(f"the native AMX path is off here ({native.amx_reason or native.reason}): nothing to compare")
        return 0
    records = []
    for kv_name in KV_DTYPES:
        for ctx, chunk in CASES:
            records += run_case(ctx, chunk, kv_name, args.reps)
    return common.finish(NAME, records, start)


if __name__ == "__main__":
    raise SystemExit(main())
