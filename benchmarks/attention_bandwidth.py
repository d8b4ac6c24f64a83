"""Achieved KV-read bandwidth of ``torch.ops.dcpgraph.paged_attention`` at decode.

Decode reads every cached K/V byte once per step and does ~2 FLOP per byte per query head, so
the kernel should run near the machine's plain read bandwidth. For each case (one query token per
request, fp32) this times, interleaved rep by rep in one process and at the same thread count:

* ``read``: ``x.sum()`` over a tensor of as many bytes as the KV the op must read;
* ``copy``: ``dst.copy_(src)`` of as many bytes (reported as source bytes per second);
* ``paged_contiguous`` / ``paged_scattered``: the op with a block table of consecutive physical
  blocks / a random permutation of them (the target: both ≥ 85 % of ``read``);
* ``torch_contiguous`` / ``torch_scattered``: the op's torch path (what it runs when the native
  kernel, :mod:`dcpgraph.ops.native`, is off or unavailable), for comparison;
* diagnostics: ``attend_no_paging`` (the same kernel, ``kernels.attend``, on pre-gathered
  contiguous K/V: the kernel alone), ``gather_scattered`` (``paged.gather_paged`` of K and V for
  the scattered table: the cost of paging as the op pays it), ``gather_index_select`` (the same
  gather as one ``index_select`` per cache: what it could cost), ``incache_ceiling`` (the op on one request whose KV
  fits in L3, repeated: what the kernel reaches when memory is not the limit, i.e. its compute
  ceiling), and ``proto_contiguous`` / ``proto_scattered``: a prototype decode path written here
  (:func:`chunked_decode_attention`: per request, chunks of ``CHUNK_TOKENS`` tokens read as
  views or by ``index_select`` into an L2-sized buffer, two matmuls, online LSE merge), checked
  against the op before timing;
* ``table_read_contiguous`` / ``table_read_scattered``: every stored byte the op reads, read in
  each table's block order with nothing else to do (:mod:`block_read`, a small C++ reader built
  on first use): the read ceiling of that table. A scattered table of 16-token blocks jumps to a
  random 4 KiB (bf16 GQA) or smaller block every block, which the hardware prefetcher cannot
  follow; the op's figure over this ceiling says how much the kernel itself loses.

``--kv-dtypes bf16 fp8`` adds, for GQA 8:1 and MLA 576/512 (16 heads) at one request of 32K, 64K
and 128K tokens, the op on bf16 and fp8 caches with **bf16 queries** (a bf16 model: the native
kernel's AMX-BF16 path where the CPU and OS allow it; fp8 bytes include their scales) against
``read`` of as many bytes, ``paged_fp32q_scattered`` (the same op with fp32 queries: the fp32
path that converts stored elements in registers), and at 32K ``torch_scattered`` (the op's torch
path: for fp8, the referenced blocks dequantised into a compact copy first) and, for fp8,
``dequant_copy`` (that compact copy alone), and both ``table_read`` ceilings. Before timing, the bf16-query result is checked
against the fp32-query result within the AMX path's stated tolerance. Target there: ≥ 75 % of
read bandwidth.

Memory, not cache: one case's KV (16–144 MiB) fits in this host's 480 MiB L3, where ``x.sum()``
reads at 2–3× the memory's speed and its figure swings with other tenants' use of the cache. So
every variant runs over ``layers`` copies of the cache (and ``read`` / ``copy`` over as many
bytes), visited in turn like a decode step's walk over its layers, with the copies adding up to
twice the last-level cache (``common.copies_past_cache``): each copy is read from memory.
``incache_ceiling`` alone stays in cache, as its name says.

Compute ceiling (bf16/fp8 cases on the fp32 path, i.e. without AMX): ``fp32_fma_ceiling_bw``, the
KV bandwidth at which a token's ``rows · (d + dv)`` multiply-adds take all of the thread's
measured fp32 FMA rate (:mod:`fma_peak`). A target above it is out of reach of any kernel that
multiplies in fp32 FMAs on that CPU; the op's figure over it is the share of the arithmetic peak
the kernel keeps.

KV bytes: GQA reads K and V (``tokens · Hkv · (D + Dv) · 4``); MLA reads its one latent cache
(``tokens · 576 · 4``; values are a prefix view of the same memory). Clock: with 1 thread the
process CPU time (``time.process_time``: the machine is shared, and a run preempted by another
engineer's job should not count), with 2 threads wall time (CPU time would count both threads);
each variant's minimum over the reps. Writes ``benchmarks/results/attention_bandwidth.json``.

    python3 benchmarks/attention_bandwidth.py [--quick]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import block_read  # noqa: E402
import common  # noqa: E402  (puts the checkout on sys.path)
import fma_peak  # noqa: E402
import torch  # noqa: E402

import dcpgraph.ops.library  # noqa: E402,F401  (registers torch.ops.dcpgraph)
from dcpgraph.ops import kernels, paged  # noqa: E402
from dcpgraph.runtime import host_memory  # noqa: E402

NAME = "attention_bandwidth"
BLOCK = 16
CHUNK_TOKENS = 2048
TARGET = 0.85

# name, requests, tokens per request, q heads, kv heads, key dim, value dim, latent (MLA)
CASES = (
    ("gqa_g8 8x8k hq=8 hkv=1 d=128", 8, 8192, 8, 1, 128, 128, False),
    ("gqa_g1 1x64k hq=1 hkv=1 d=128", 1, 65536, 1, 1, 128, 128, False),
    ("mla 8x8k hq=16 latent=576/512", 8, 8192, 16, 1, 576, 512, True),
)
# Typed-cache cases (the targets in docs/benchmarks.md: GQA 8:1 and MLA 576/512 at 32K-128K context).
TYPED_CASES = tuple(
    case
    for seq in (32768, 65536, 131072)
    for case in (
        (f"gqa_g8 1x{seq // 1024}k hq=8 hkv=1 d=128", 1, seq, 8, 1, 128, 128, False),
        (f"mla 1x{seq // 1024}k hq=16 latent=576/512", 1, seq, 16, 1, 576, 512, True),
    )
)
TYPED_TARGET = 0.75
KV_DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
# --quick: the same shapes with the MLA case at 4k tokens per request (72 MiB: still over L3).
QUICK_CASES = (*CASES[:2], ("mla 8x4k hq=16 latent=576/512", 8, 4096, 16, 1, 576, 512, True))


def request_tables(nreq: int, seq: int, nb: int, gen: torch.Generator):
    """``(cu_seqlens_q, kv_lens, contiguous table, scattered table)`` for ``nreq`` one-query
    requests of ``seq`` keys over ``nb`` blocks (the scattered table a random permutation)."""
    cu = torch.arange(nreq + 1, dtype=torch.int32)
    lens = torch.full((nreq,), seq, dtype=torch.int32)
    contiguous = torch.arange(nb, dtype=torch.int32).view(nreq, -1)
    scattered = torch.randperm(nb, generator=gen).to(torch.int32).view(nreq, -1)
    return cu, lens, contiguous, scattered

def chunked_decode_attention(q, k_cache, v_cache, block_table, cu_seqlens_q, kv_lens, scale,
                             chunk_tokens: int = CHUNK_TOKENS):
    """Prototype of a faster paged decode path (no ``kv_bound``): ``(out, lse)`` like the op.

    Per request: the block table row is checked for being one run of consecutive blocks (then
    chunks are views); otherwise each chunk of blocks is gathered with one ``index_select`` into
    an L2-sized buffer. Each chunk: ``scores = q·Kᵀ`` (one matmul over all query heads of a KV
    head), softmax statistics, ``p·V`` (one matmul), merged into the running result by LSE. For
    MLA (values a prefix view of the latent) a scattered chunk is gathered once and its values
    are a view of it.
    """
    tq, hq, d = q.shape
    _, block, hkv, _ = k_cache.shape
    dv = v_cache.shape[-1]
    g = hq // hkv
    latent = v_cache.data_ptr() == k_cache.data_ptr() and dv < d
    out = torch.zeros(tq, hq, dv, dtype=q.dtype)
    lse = torch.full((tq, hq), float("-inf"), dtype=torch.float32)
    cq = cu_seqlens_q.tolist()
    lens = kv_lens.tolist()
    per_chunk = max(1, chunk_tokens // block)
    for r, n in enumerate(lens):
        q0, q1 = cq[r], cq[r + 1]
        lq = q1 - q0
        if lq == 0 or n <= 0:
            continue
        nblk = -(-n // block)
        ids = block_table[r, :nblk].to(torch.int64)
        contiguous = nblk == 1 or bool((ids[1:] - ids[:-1] == 1).all())
        first = int(ids[0])
        qh = (q[q0:q1] * scale).reshape(lq, hkv, g, d).permute(1, 2, 0, 3).reshape(hkv, g * lq, d)
        m = l_ = o = None
        for c0 in range(0, nblk, per_chunk):
            c1 = min(nblk, c0 + per_chunk)
            ntok = min(n, c1 * block) - c0 * block
            if contiguous:
                kc, vc = k_cache[first + c0 : first + c1], v_cache[first + c0 : first + c1]
            else:
                sel = ids[c0:c1]
                kc = k_cache.index_select(0, sel)
                vc = kc[..., :dv] if latent else v_cache.index_select(0, sel)
            kc = kc.reshape(-1, hkv, d)[:ntok]
            vc = vc.reshape(-1, hkv, dv)[:ntok]
            s = torch.matmul(qh, kc.permute(1, 2, 0))  # [hkv, g·lq, ntok]
            mc = s.amax(-1, keepdim=True)
            p = torch.exp(s - mc)
            lc = p.sum(-1, keepdim=True)
            oc = torch.matmul(p, vc.permute(1, 0, 2))  # [hkv, g·lq, dv]
            if m is None:
                m, l_, o = mc, lc, oc
            else:
                mn = torch.maximum(m, mc)
                a, b = torch.exp(m - mn), torch.exp(mc - mn)
                o, l_, m = o * a + oc * b, l_ * a + lc * b, mn
        out[q0:q1] = (o / l_).reshape(hkv, g, lq, dv).permute(2, 0, 1, 3).reshape(lq, hq, dv)
        lse[q0:q1] = (m + torch.log(l_)).reshape(hkv, g, lq).permute(2, 0, 1).reshape(lq, hq)
    return out, lse


def _timer(threads: int):
    return time.process_time if threads == 1 else time.perf_counter


def measure(fns: dict, reps: int, clock) -> dict[str, float]:
    for fn in fns.values():
        fn()
    best = {k: float("inf") for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            start = clock()
            fn()
            best[k] = min(best[k], clock() - start)
    return best


def table_read_fns(copies, contiguous, scattered, blocks: int) -> dict:
    """``table_read_contiguous`` / ``table_read_scattered``: every stored byte of each layer's
    cache (``copies``: per layer the tensors the op reads, one block per dim-0 slice) read in the
    table's block order with nothing else to do (:mod:`block_read`): the read ceiling of that
    table, against which the op's figure on it says how much the kernel itself loses. Empty where
    the reader does not build (printed)."""
    fns = {}
    for name, table in (("table_read_contiguous", contiguous), ("table_read_scattered", scattered)):
        readers = [block_read.reader(tensors, table, blocks) for tensors in copies]
        if any(r is None for r in readers):
            print(f"  {name} left out: {block_read.unavailable_reason()}")
            return {}
        fns[name] = lambda readers=readers: [r() for r in readers]
    return fns


def print_ceilings(label: str, bw: dict) -> None:
    """The op against its table's read ceiling (where measured)."""
    if "table_read_scattered" not in bw:
        return
    print(f"  {label}: table read ceiling: contiguous {bw['table_read_contiguous']:.1f} GB/s, scattered "
          f"{bw['table_read_scattered']:.1f} GB/s ({bw['table_read_scattered'] / bw['read']:.0%} of read); the op at "
          f"{bw['paged_contiguous'] / bw['table_read_contiguous']:.0%} / "
          f"{bw['paged_scattered'] / bw['table_read_scattered']:.0%} of its table's ceiling")


def run_case(case, threads: int, reps: int) -> list[dict]:
    label, nreq, seq, hq, hkv, d, dv, latent = case
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    nb = nreq * seq // BLOCK
    k_cache = torch.randn(nb, BLOCK, hkv, d, generator=gen)
    v_cache = k_cache[..., :dv] if latent else torch.randn(nb, BLOCK, hkv, dv, generator=gen)
    kv_bytes = k_cache.numel() * 4 + (0 if latent else v_cache.numel() * 4)
    # Layers: copies of the cache visited in turn, twice the last-level cache in all, so every
    # variant reads from memory as a decode step does (one layer's KV alone fits in this host's L3).
    layers = common.copies_past_cache(kv_bytes)
    copies = [(k_cache, v_cache)]
    for _ in range(layers - 1):
        kc = k_cache.clone()
        copies.append((kc, kc[..., :dv] if latent else v_cache.clone()))
    total = layers * kv_bytes
    src = torch.ones(total // 4)
    dst = torch.empty_like(src)
    q = torch.randn(nreq, hq, d, generator=gen)
    cu, lens, contiguous, scattered = request_tables(nreq, seq, nb, gen)
    scale = d ** -0.5
    op = torch.ops.dcpgraph.paged_attention

    # The prototype must agree with the op before its time means anything.
    for table in (contiguous, scattered):
        ref_o, ref_l = op(q, k_cache, v_cache, table, cu, lens, None, scale)
        o, l_ = chunked_decode_attention(q, k_cache, v_cache, table, cu, lens, scale)
        torch.testing.assert_close(o, ref_o, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(l_, ref_l, atol=1e-4, rtol=1e-4)

    sc_rows = [scattered[i].tolist() for i in range(nreq)]
    sc_ids = [scattered[i].to(torch.int64) for i in range(nreq)]
    torch_path = paged._paged_partial_attention_torch

    def layer_fns(k_cache, v_cache) -> dict:
        """One layer's variants (the op, the torch path, the diagnostics) over its own cache."""
        flat_k = [k_cache[i * (seq // BLOCK) : (i + 1) * (seq // BLOCK)].reshape(seq, hkv, d) for i in range(nreq)]
        if latent:  # values are a prefix view of the key (as the paged path passes them)
            flat_v = [k[..., :dv] for k in flat_k]
        else:
            flat_v = [v_cache[i * (seq // BLOCK) : (i + 1) * (seq // BLOCK)].reshape(seq, hkv, dv) for i in range(nreq)]

        # The gathers as the op does them: one request at a time, each result dropped before the
        # next (so the allocator can reuse its memory, as in the op); MLA gathers its latent once.
        def gather_paged_all():
            for i in range(nreq):
                k = paged.gather_paged(k_cache, sc_rows[i], seq)
                v = None if latent else paged.gather_paged(v_cache, sc_rows[i], seq)
                del k, v

        def index_select_all():
            for i in range(nreq):
                k = k_cache.index_select(0, sc_ids[i])
                v = None if latent else v_cache.index_select(0, sc_ids[i])
                del k, v

        return {
            "paged_contiguous": lambda: op(q, k_cache, v_cache, contiguous, cu, lens, None, scale),
            "paged_scattered": lambda: op(q, k_cache, v_cache, scattered, cu, lens, None, scale),
            # the torch path the op took before the native kernel (views / gathers + aten's flash kernel)
            "torch_contiguous": lambda: torch_path(q, k_cache, v_cache, contiguous, cu, lens, None, scale),
            "torch_scattered": lambda: torch_path(q, k_cache, v_cache, scattered, cu, lens, None, scale),
            "attend_no_paging": lambda: [kernels.attend(q[i : i + 1], flat_k[i], flat_v[i], scale) for i in range(nreq)],
            "gather_scattered": gather_paged_all,
            "gather_index_select": index_select_all,
            "proto_contiguous": lambda: chunked_decode_attention(q, k_cache, v_cache, contiguous, cu, lens, scale),
            "proto_scattered": lambda: chunked_decode_attention(q, k_cache, v_cache, scattered, cu, lens, scale),
        }

    per_layer = [layer_fns(*c) for c in copies]

    def every_layer(name):
        fns_ = [fns[name] for fns in per_layer]
        return lambda: [f() for f in fns_]

    # In-cache ceiling: one request whose KV (~8 MiB) sits in L3, run `inner` times per timing.
    small_tokens = max(BLOCK, (8 << 20) // (hkv * (d + (0 if latent else dv)) * 4) // BLOCK * BLOCK)
    small_nb = small_tokens // BLOCK
    sk = k_cache[:small_nb]
    sv = v_cache[:small_nb]
    small_bytes = sk.numel() * 4 + (0 if latent else sv.numel() * 4)
    inner = max(1, total // small_bytes)
    small_table = torch.arange(small_nb, dtype=torch.int32).view(1, -1)
    small_lens = torch.tensor([small_tokens], dtype=torch.int32)
    cu1 = torch.arange(2, dtype=torch.int32)
    q1 = q[:1]

    def incache():
        for _ in range(inner):
            op(q1, sk, sv, small_table, cu1, small_lens, None, scale)

    fns = {"read": lambda: src.sum(), "copy": lambda: dst.copy_(src)}
    fns.update({name: every_layer(name) for name in per_layer[0]})
    fns["incache_ceiling"] = incache
    fns.update(table_read_fns([[kc] if latent else [kc, vc] for kc, vc in copies], contiguous, scattered, seq // BLOCK))
    clock = _timer(threads)
    best = measure(fns, reps, clock)
    bw = {k: total / t / 1e9 for k, t in best.items()}
    read = bw["read"]
    # Why it falls short, in numbers: is the kernel limited by memory or by itself, and what
    # share of the scattered case is the gather?
    bound = bw["paged_contiguous"] / bw["incache_ceiling"]
    gather_share = best["gather_scattered"] / best["paged_scattered"]
    print(f"  diagnosis: contiguous op at {bw['paged_contiguous'] / read:.0%} of read; with its KV in L3 the "
          f"op reaches {bw['incache_ceiling'] / read:.0%} of read (from DRAM it runs at {bound:.0%} of its in-cache "
          f"speed: {'the kernel, not memory, is the limit' if bound >= 0.9 else 'memory is the limit'}); scattered table "
          f"×{best['paged_scattered'] / best['paged_contiguous']:.1f} slower, gather_paged = "
          f"{gather_share:.0%} of it (one index_select: ×{best['gather_scattered'] / best['gather_index_select']:.1f} "
          f"faster than gather_paged); prototype scattered ×{best['paged_scattered'] / best['proto_scattered']:.1f} "
          f"faster than the op")
    config = (f"{label} fp32 block={BLOCK} threads={threads} native={'on' if paged.native_enabled() else 'off'} "
              f"KV={kv_bytes / 2**20:.0f}MiB x {layers} layers "
              f"clock={'cpu' if threads == 1 else 'wall'} min-of-{reps} {common.load_note()}")
    print_ceilings(label, bw)
    recs = [common.record(NAME, config, "read_bandwidth", read, "GB/s", digits=4)]
    for key in ("copy", "paged_contiguous", "paged_scattered", "torch_contiguous", "torch_scattered", "attend_no_paging", "gather_scattered",
                "gather_index_select", "incache_ceiling", "proto_contiguous", "proto_scattered",
                *(k for k in ("table_read_contiguous", "table_read_scattered") if k in bw)):
        metric = key + "_bandwidth" if key in ("copy",) else f"{key}_bw"
        rec = common.record(NAME, config, metric, bw[key], "GB/s", baseline=read, digits=4)
        if key in ("paged_contiguous", "paged_scattered"):
            ratio = bw[key] / read
            common.with_target(rec, f"≥ {TARGET:.0%} of read bandwidth", ratio >= TARGET,
                               f"at {ratio:.0%} of read: {1 - ratio / TARGET:.0%} short of the target "
                               f"(needs {TARGET * read:.1f} GB/s, got {bw[key]:.1f})")
        recs.append(rec)
    return recs


def run_typed_case(case, kv_name: str, huge_pages: bool, threads: int, reps: int) -> list[dict]:
    """The op on a bf16 or fp8 cache with bf16 queries: bandwidth of its stored bytes (scales
    included). ``huge_pages``: the caches and ``read``'s tensor on 2 MiB pages, as the engine
    allocates its host caches (:mod:`dcpgraph.runtime.host_memory`)."""
    from dcpgraph.ops import native, quant

    label, nreq, seq, hq, hkv, d, dv, latent = case
    kv_dtype = KV_DTYPES[kv_name]
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    nb = nreq * seq // BLOCK
    k, ks, k_exact = paged._stored_as(torch.randn(nb, BLOCK, hkv, d, generator=gen), kv_dtype)
    if latent:
        v, vs, v_exact = k[..., :dv], None, k_exact[..., :dv]
    else:
        v, vs, v_exact = paged._stored_as(torch.randn(nb, BLOCK, hkv, dv, generator=gen), kv_dtype)
    stored = [k] if latent else [k, v]
    stored += [x for x in (ks, vs) if x is not None]
    kv_bytes = sum(x.numel() * x.element_size() for x in stored)
    del k_exact, v_exact  # not needed: the check compares with the exact fp32-query path
    # Layers: copies of the cache visited in turn, twice the last-level cache in all, so every
    # variant reads from memory as a decode step does (one layer's KV alone fits in this host's L3).
    layers = common.copies_past_cache(kv_bytes)

    def place(x):
        if x is None:
            return None
        return host_memory.zeros(tuple(x.shape), x.dtype).copy_(x) if huge_pages else x.clone()

    copies = [] if huge_pages else [(k, v, ks, vs)]
    while len(copies) < layers:
        kc = place(k)
        copies.append((kc, kc[..., :dv] if latent else place(v), place(ks), place(vs)))
    k, v, ks, vs = copies[0]
    total = layers * kv_bytes
    src = host_memory.zeros((total // 4,), torch.float32).fill_(1) if huge_pages else torch.ones(total // 4)
    q32 = torch.randn(nreq, hq, d, generator=gen).to(torch.bfloat16).float()
    q = q32.to(torch.bfloat16)
    cu, lens, contiguous, scattered = request_tables(nreq, seq, nb, gen)
    scale = d ** -0.5
    op = torch.ops.dcpgraph.paged_attention
    fp8 = kv_name == "fp8"

    def torch_path(k, v, ks, vs, table):
        kc, vc, t = (quant.dequantized_context(k, v, ks, vs, table, lens, q.dtype) if fp8 else (k, v, table))
        return paged._paged_partial_attention_torch(q, kc, vc, t, cu, lens, None, scale)

    # The bf16-query op must agree with the exact fp32 path before its time means anything.
    ref = op(q32, k, v, scattered, cu, lens, None, scale, k_scales=ks, v_scales=vs)
    got = op(q, k, v, scattered, cu, lens, None, scale, k_scales=ks, v_scales=vs)
    amx = native.amx_enabled(kv_dtype)
    out_tol, lse_tol = (native.AMX_OUT_TOL, native.AMX_LSE_TOL) if amx else (1e-2, 1e-5)
    torch.testing.assert_close(got[0].float(), ref[0], atol=out_tol, rtol=out_tol)
    torch.testing.assert_close(got[1], ref[1], atol=lse_tol, rtol=lse_tol)
    def each_layer(query, table):
        return lambda: [op(query, kc, vc, table, cu, lens, None, scale, k_scales=ksc, v_scales=vsc)
                        for kc, vc, ksc, vsc in copies]

    fns = {
        "read": lambda: src.sum(),
        "paged_contiguous": each_layer(q, contiguous),
        "paged_scattered": each_layer(q, scattered),
        "paged_fp32q_scattered": each_layer(q32, scattered),
    }
    fns.update(table_read_fns([[x for x in ((kc,) if latent else (kc, vc)) + (ksc, vsc) if x is not None]
                               for kc, vc, ksc, vsc in copies], contiguous, scattered, seq // BLOCK))
    if seq <= TYPED_CASES[0][2]:  # the slow comparisons at the shortest context only
        fns["torch_scattered"] = lambda: [torch_path(*c, scattered) for c in copies]
        if fp8:
            fns["dequant_copy"] = lambda: [quant.dequantized_context(*c, scattered, lens, q.dtype) for c in copies]
    best = measure(fns, reps, _timer(threads))
    bw = {name: total / t / 1e9 for name, t in best.items()}
    read = bw["read"]
    print_ceilings(label, bw)
    native_on = paged.native_enabled(kv_dtype)
    path = "amx" if amx else f"fp32 ({native.amx_reason})"
    # The fp32 path's compute ceiling: rows · (d + dv) multiply-adds a token per KV head, at this
    # CPU's measured FMA rate (one thread's, times the threads), per stored byte of the token.
    ceiling = None
    if not amx and (rate := fma_peak.fma_rate()) is not None:
        rows = hq // hkv
        token_bytes = kv_bytes / (nb * BLOCK * hkv)
        ceiling = fma_peak.compute_ceiling(rate * threads, rows, d, dv, token_bytes) / 1e9
        print(f"  {label} {kv_name}: fp32 FMA compute ceiling {ceiling:.2f} GB/s ({ceiling / read:.0%} of read: "
              f"{rows} rows x {d}+{dv} multiply-adds per {token_bytes:.0f} B token at {rate / 1e9:.1f} G lanes/s a "
              f"thread); the op at {bw['paged_scattered'] / ceiling:.0%} of it (scattered)")
    elif not amx:
        print(f"  compute ceiling left out: {fma_peak.unavailable_reason()}")
    config = (f"{label} {kv_name} q=bf16 path={path} block={BLOCK} threads={threads} native={'on' if native_on else 'off'} "
              f"KV={kv_bytes / 2**20:.0f}MiB x {layers} layers{' pages=2M' if huge_pages else ''} "
              f"clock={'cpu' if threads == 1 else 'wall'} min-of-{reps} "
              f"{common.load_note()}")
    recs = [common.record(NAME, config, "read_bandwidth", read, "GB/s", digits=4)]
    if ceiling is not None:
        recs.append(common.record(NAME, config, "fp32_fma_ceiling_bw", ceiling, "GB/s", baseline=read, digits=4))
    for name in fns:
        if name == "read":
            continue
        rec = common.record(NAME, config, f"{name}_bw", bw[name], "GB/s", baseline=read, digits=4)
        if name in ("paged_contiguous", "paged_scattered"):  # the bf16-query op: the target rows
            ratio = bw[name] / read
            bound = ("" if ceiling is None else
                     f"; this CPU's fp32 FMA ceiling is {ceiling / read:.0%} of read, the op at {bw[name] / ceiling:.0%} of it")
            common.with_target(rec, f"≥ {TYPED_TARGET:.0%} of read bandwidth", ratio >= TYPED_TARGET,
                               f"at {ratio:.0%} of read ({bw[name]:.1f} of {read:.1f} GB/s){bound}")
        recs.append(rec)
    return recs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer reps and a shorter MLA case (still read from memory: see the layers)")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--kv-dtypes", nargs="*", default=["fp32", "bf16", "fp8"],
                        choices=["fp32", *KV_DTYPES], help="cache dtypes to measure (fp32: the full diagnostics)")
    parser.add_argument("--huge-pages", action="store_true",
                        help="bf16/fp8 cases: the caches and read's tensor on huge pages, as the engine allocates "
                             "its caches (runtime.host_memory); results to attention_bandwidth_typed_hugepages.json")
    args = parser.parse_args(argv)
    if args.huge_pages and "fp32" in args.kv_dtypes:
        parser.error("--huge-pages measures the bf16/fp8 cases: pass --kv-dtypes bf16 fp8 (or one of them)")
    huge_pages = args.huge_pages and not host_memory.status()
    if args.huge_pages and not huge_pages:
        print(f"--huge-pages: not available here ({host_memory.status()}); 4 KiB pages")
    reps = args.reps or (3 if args.quick else 9)
    start = time.perf_counter()
    records = []
    for threads in args.threads:
        runs = [(run_case, (case,)) for case in (QUICK_CASES if args.quick else CASES)] if "fp32" in args.kv_dtypes else []
        runs += [(run_typed_case, (case, name, huge_pages))
                 for name in KV_DTYPES if name in args.kv_dtypes for case in TYPED_CASES]
        for fn, case_args in runs:
            recs = fn(*case_args, threads, reps)
            print(recs[0]["config"])
            common.print_records(recs)
            records += recs
    # bf16/fp8 alone write their own file, leaving the full fp32 diagnostics' results in place.
    out = common.write(NAME if "fp32" in args.kv_dtypes else f"{NAME}_typed{'_hugepages' if huge_pages else ''}",
                       records)
    met = [r for r in records if "target" in r]
    print("targets (paged attention: fp32 ≥ 85 %, bf16/fp8 ≥ 75 % of read bandwidth): "
          f"{sum(r['met'] for r in met)}/{len(met)} rows met; "
          f"best {max(r['ratio'] for r in met):.0%}, worst {min(r['ratio'] for r in met):.0%} of read")
    print(f"wrote {out} in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
