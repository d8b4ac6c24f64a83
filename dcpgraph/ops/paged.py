"""Paged KV: reading attention through a block table, and writing new tokens into their slots.

A cache is ``[num_blocks, block, heads, dim]``; local key ``j`` of a row lives at slot
``block_table[row, j // block]·block + j % block``, and slot −1 means "not this rank's token".
:func:`paged_partial_attention` is the op's kernel: the native C++ decode kernel (:mod:`.native`)
where it applies and is enabled for the cache's dtype (each dtype self-checked once against the
torch path here), else the torch path, which attends with :mod:`.kernels` over views or one
gather of the row's blocks. Shapes and score modifiers are :mod:`.kernels`'.
"""

from __future__ import annotations

import os

import torch

from . import native
from .kernels import acc_dtype, attend, empty_result, is_prefix_view, soft_cap, softmax_attend
from .native_build import SelfCheckedKernel


def gather_paged(cache: torch.Tensor, block_ids: list[int], length: int) -> torch.Tensor:
    """The first ``length`` tokens of a request from a paged cache ``[NB, B, H, D]`` as ``[L, H, D]``.

    Consecutive physical blocks are returned as a view (no copy); otherwise one ``index_select``
    gathers every block in a single pass (a run-by-run ``cat`` cost several times more).
    """
    block = cache.shape[1]
    # A block table row that is too short (or holds padding / out-of-range ids where real blocks
    # are needed) would otherwise attend over fewer keys without a word, or fail in a reshape.
    if len(block_ids) * block < length:
        raise ValueError(
            f"paged attention: {length} tokens need {-(-length // block)} blocks of {block}, "
            f"but the block table row has {len(block_ids)}"
        )
    bad = [b for b in block_ids if not 0 <= b < cache.shape[0]]
    if bad:
        raise ValueError(
            f"paged attention: block ids {bad} outside the cache's {cache.shape[0]} blocks"
        )
    first, count = block_ids[0], len(block_ids)
    if block_ids[-1] - first == count - 1 and block_ids == list(range(first, first + count)):
        return cache[first : first + count].reshape(count * block, *cache.shape[2:])[:length]
    index = torch.tensor(block_ids, dtype=torch.int64, device=cache.device)
    return cache.index_select(0, index).reshape(count * block, *cache.shape[2:])[:length]


# Decode batches whose longest context is at most this many tokens run as one batched gather + two
# batched matmuls instead of a Python loop over requests (per-call overhead dominates there);
# longer contexts keep the per-request streaming kernel, which reads the cache in place.
BATCHED_DECODE_TOKENS = 512


def _paged_decode_batched(q, k_cache, v_cache, block_table, kv_lens, scale, value_prefix, kv_start=None, softcap=0.0):
    """One query per row: gather every row's context into ``[R, Lmax, Hkv, D]`` with one index
    op, mask keys past each row's length (and before its ``kv_start``), and attend with batched
    matmuls in the accumulation dtype. Rows with no keys give ``(0, −inf)``."""
    rows, hq, d = q.shape
    block, hkv = k_cache.shape[1], k_cache.shape[2]
    dv = v_cache.shape[-1]
    longest = int(kv_lens.max())
    positions = torch.arange(longest, device=q.device)
    width = (longest + block - 1) // block
    if block_table.shape[1] < width:
        raise ValueError(
            f"paged attention: {longest} tokens need {width} blocks of {block}, "
            f"but the block table row has {block_table.shape[1]}"
        )
    table = block_table.to(torch.int64)[:, :width]
    needed = torch.arange(width, device=q.device).unsqueeze(0) * block < kv_lens.to(q.device).unsqueeze(1)
    bad = needed & ((table < 0) | (table >= k_cache.shape[0]))
    if bool(bad.any()):
        raise ValueError(
            f"paged attention: block ids {table[bad].tolist()} outside the cache's {k_cache.shape[0]} blocks"
        )
    slots = table.gather(1, (positions // block).unsqueeze(0).expand(rows, -1)) * block + positions % block
    valid = positions.unsqueeze(0) < kv_lens.to(positions.device).unsqueeze(1)  # [R, L]
    slots = torch.where(valid, slots, 0).reshape(-1)
    if kv_start is not None:
        valid = valid & (positions.unsqueeze(0) >= kv_start.to(positions.device).unsqueeze(1))
    acc = acc_dtype(q.dtype)
    keys = k_cache.reshape(-1, hkv, k_cache.shape[-1]).index_select(0, slots).reshape(rows, longest, hkv, -1)
    if value_prefix:
        values = keys[..., :dv]
    else:
        values = v_cache.reshape(-1, hkv, dv).index_select(0, slots).reshape(rows, longest, hkv, dv)
    group = hq // hkv
    qg = q.to(acc).reshape(rows, hkv, group, d)  # [R, Hkv, G, D]
    scores = soft_cap(torch.matmul(qg, keys.to(acc).permute(0, 2, 3, 1)) * scale, softcap)  # [R, Hkv, G, L]
    out, lse = softmax_attend(scores, values.to(acc).permute(0, 2, 1, 3), valid[:, None, None, :])
    return out.reshape(rows, hq, dv).to(q.dtype), lse.reshape(rows, hq)


def _is_suffix_causal(bound: torch.Tensor, keys: int) -> bool:
    """The bound is bottom-right causal: query ``i`` of ``n`` sees keys ``< keys − n + 1 + i``."""
    n = bound.numel()
    return bool(torch.equal(bound.to(torch.int64), torch.arange(keys - n + 1, keys + 1, device=bound.device)))


def causal_runs(bound: torch.Tensor, keys: int) -> list[tuple[int, int, int]] | None:
    """``bound`` cut into runs ``(i0, i1, end)`` that are each bottom-right causal over the first
    ``end`` keys (``bound[i0:i1] = end − (i1 − i0) + 1 .. end``), e.g. a PCP rank's two zigzag
    chunks of one request; None when some bound exceeds ``keys`` (the length then clamps it)."""
    values = bound.to(torch.int64).tolist()
    if not values or max(values) > keys:
        return None
    runs, i0 = [], 0
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] != values[i - 1] + 1:
            runs.append((i0, i, values[i - 1]))
            i0 = i
    return runs


# Per KV dtype: True/False once decided; ("reason", dtype): why it is off; "reason": the latest such.
_native_state: dict[object, object] = {}


def _native_off(kv_dtype: torch.dtype, reason: str | None) -> bool:
    _native_state[("reason", kv_dtype)] = _native_state["reason"] = reason
    return False


def native_enabled(kv_dtype: torch.dtype = torch.float32) -> bool:
    """Whether paged decode over a ``kv_dtype`` cache goes through the native kernel
    (:mod:`dcpgraph.ops.native`).

    ``DCPGRAPH_NATIVE=0`` disables it. Otherwise, on first use for a KV dtype, the kernel is built
    (or loaded from its persistent build directory) and must match the torch path, run on the same
    values in fp32, on a tiny self-check (GQA with 3 and 4 query heads per KV head, separate and
    prefix-view values, scattered blocks, lengths 0 / partial block); any failure leaves that dtype off for this process, with the reason
    in ``_native_state[("reason", kv_dtype)]`` (and ``_native_state["reason"]``)."""
    if os.environ.get("DCPGRAPH_NATIVE", "1") == "0":
        return False
    ok = _native_state.get(kv_dtype)
    if ok is None:
        ok = _native_self_check(kv_dtype)
        _native_state[kv_dtype] = ok
    return bool(ok)


def _stored_as(x: torch.Tensor, kv_dtype: torch.dtype):
    """``(stored, scales, exact fp32 values)`` of ``x [NB, B, H, D]`` in a ``kv_dtype`` cache."""
    from . import quant

    if quant.is_fp8(kv_dtype):
        nb, block, h, d = x.shape
        stored, scales = quant.quantize_fp8(x.reshape(-1, h, d))
        stored, scales = stored.view(nb, block, h, d), scales.view(nb, block, h, -1)
        return stored, scales, quant.dequantize_fp8(stored, scales, torch.float32)
    stored = x.to(kv_dtype)
    return stored, None, stored.to(torch.float32)


def _native_self_check(kv_dtype: torch.dtype) -> bool:
    if not native.available():
        return _native_off(kv_dtype, native.reason)
    if kv_dtype not in native.kv_dtypes():
        return _native_off(kv_dtype, f"this native build reads {native.kv_dtypes()} KV caches only")
    try:
        gen = torch.Generator().manual_seed(1234)
        nb, block, hkv, d = 12, 4, 2, 24
        k_cache, k_scales, k_exact = _stored_as(torch.randn(nb, block, hkv, d, generator=gen), kv_dtype)
        v_cache, v_scales, v_exact = _stored_as(torch.randn(nb, block, hkv, 16, generator=gen), kv_dtype)
        table = torch.randperm(nb, generator=gen)[:9].view(3, 3).to(torch.int32)
        lens = torch.tensor([0, 5, 11], dtype=torch.int32)
        cu = torch.arange(4, dtype=torch.int32)
        # 3 and 4 query heads per KV head: partial and whole 4-row register tiles (each ISA's
        # widest tile, whose horizontal sums are written per ISA, is a whole one)
        cases = [(torch.randn(3, hq, d, generator=gen), v, vs, v_ref) for hq in (6, 8)
                 for v, vs, v_ref in ((v_cache, v_scales, v_exact), (k_cache[..., :16], None, k_exact[..., :16]))]
        for q, v, vs, v_ref in cases:
            ref = _paged_partial_attention_torch(q, k_exact, v_ref, table, cu, lens, None, 0.3)
            got = native.native_paged_decode(q, k_cache, v, table, cu, lens, 0.3, k_scales=k_scales, v_scales=vs,
                                             chunk_tokens=4)
            if got is None or not (torch.allclose(got[0], ref[0], atol=1e-5, rtol=1e-5)
                                   and torch.equal(torch.isinf(got[1]), torch.isinf(ref[1]))
                                   and torch.allclose(got[1], ref[1], atol=1e-5, rtol=1e-5)):
                return _native_off(kv_dtype, f"native paged-decode kernel failed its {kv_dtype} self-check")
    except Exception as exc:  # noqa: BLE001 - a broken kernel only disables itself
        return _native_off(kv_dtype, f"native {kv_dtype} self-check raised {type(exc).__name__}: {exc}")
    return True


def paged_partial_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    kv_lens: torch.Tensor,
    kv_bound: torch.Tensor | None,
    scale: float,
    kv_start: torch.Tensor | None = None,
    softcap: float = 0.0,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row ``r``'s queries attend to its first ``kv_lens[r]`` cached tokens.

    Local key ``j`` of row ``r`` lives at slot ``block_table[r, j // B]·B + j % B``; with
    ``kv_bound`` query ``t`` sees only keys ``j < kv_bound[t]``, with ``kv_start`` only keys
    ``j >= kv_start[t]`` (a sliding window), and ``softcap`` caps every score. fp8 caches come with
    their scales (``k_scales``, and ``v_scales`` unless the values are a prefix of the keys,
    :mod:`dcpgraph.ops.quant`).

    fp32/bf16 CPU queries without ``kv_start`` and ``softcap`` run the native kernel when it is
    enabled for the cache's dtype (:func:`native_enabled`); it reads fp32, bf16 and fp8 caches in
    place and knows neither a window nor a cap. ``kv_bound`` goes with them: bf16 queries on the
    AMX path apply it per query row (decode, speculative verification and chunked prefill alike, no
    gathered copy); the fp32 path takes a one-query row's bound as its length, and rows of at most
    :data:`MAX_BOUNDED_QUERIES_PER_ROW` bounded queries become one row per query
    (:func:`_bound_as_lengths`). Everything else, and a block table that does not cover a row,
    takes the checked torch path, which reads an fp8 cache through
    :func:`~dcpgraph.ops.quant.dequantized_context` (the blocks the step uses, dequantised).
    """
    if (kv_start is None and not softcap and q.dtype in (torch.float32, torch.bfloat16) and q.device.type == "cpu"
            and native_enabled(k_cache.dtype)):
        # The AMX path applies bounds per query row, the fp32 path as the lengths of one-query rows;
        # the fp32 path's rows of several bounded queries become one row per query here.
        amx = q.dtype == torch.bfloat16 and native.amx_enabled(k_cache.dtype)
        res = native.native_paged_decode(q, k_cache, v_cache, block_table, cu_seqlens_q, kv_lens, scale,
                                         k_scales=k_scales, v_scales=v_scales, amx=amx, kv_bound=kv_bound)
        if res is None and kv_bound is not None and not amx:
            args = _bound_as_lengths(block_table, cu_seqlens_q, kv_lens, kv_bound)
            if args is not None:
                res = native.native_paged_decode(q, k_cache, v_cache, *args, scale, k_scales=k_scales,
                                                 v_scales=v_scales, amx=False)
        if res is not None:
            return res
    if k_scales is not None:
        from . import quant

        k_cache, v_cache, block_table = quant.dequantized_context(
            k_cache, v_cache, k_scales, v_scales, block_table, kv_lens, q.dtype
        )
    return _paged_partial_attention_torch(
        q, k_cache, v_cache, block_table, cu_seqlens_q, kv_lens, kv_bound, scale, kv_start, softcap
    )


MAX_CAUSAL_RUNS = 8  # a PCP rank's zigzag chunks and padding; more runs keep the masked path
MAX_BOUNDED_QUERIES_PER_ROW = 16  # speculative verification sizes; longer rows keep the torch path


def _bound_as_lengths(block_table, cu_seqlens_q, kv_lens, kv_bound):
    """A ``kv_bound`` as per-row lengths: every query token becomes its own one-query row that
    shares its request's table row, with length ``min(kv_lens[row], kv_bound[t])`` — the same keys,
    so the same result. ``None`` for rows of more than :data:`MAX_BOUNDED_QUERIES_PER_ROW` queries
    (prefill chunks), where re-reading the context per token would cost more than the torch path."""
    rows = kv_lens.shape[0]
    if (cu_seqlens_q.shape[0] == block_table.shape[0] + 1 == rows + 1 == kv_bound.shape[0] + 1
            and torch.equal(cu_seqlens_q, torch.arange(rows + 1, dtype=cu_seqlens_q.dtype))):
        # One query per row (decode): the rows already are one-query rows.
        return block_table, cu_seqlens_q, torch.minimum(kv_lens.to(torch.int64), kv_bound.to(torch.int64))
    cu = cu_seqlens_q.to(torch.int64)
    counts = cu[1:] - cu[:-1]
    if counts.numel() and int(counts.max()) > MAX_BOUNDED_QUERIES_PER_ROW:
        return None
    owner = torch.repeat_interleave(torch.arange(counts.numel()), counts)
    lens = torch.minimum(kv_lens.to(torch.int64)[owner], kv_bound.to(torch.int64))
    return block_table[owner], torch.arange(owner.numel() + 1, dtype=cu_seqlens_q.dtype), lens


def _paged_partial_attention_torch(
    q, k_cache, v_cache, block_table, cu_seqlens_q, kv_lens, kv_bound, scale, kv_start=None, softcap=0.0
):
    """The torch path of :func:`paged_partial_attention` (views / gathers + aten kernels)."""
    tq, hq, _ = q.shape
    block = k_cache.shape[1]
    value_prefix = is_prefix_view(v_cache, k_cache)
    cq = cu_seqlens_q.tolist()
    lens = kv_lens.tolist()
    rows = len(lens)
    if tq == rows and cq == list(range(rows + 1)) and 0 < max(lens, default=0) <= BATCHED_DECODE_TOKENS:
        if kv_bound is not None:
            kv_lens = torch.minimum(kv_lens.to(torch.int64), kv_bound.to(torch.int64))
        return _paged_decode_batched(q, k_cache, v_cache, block_table, kv_lens, scale, value_prefix, kv_start, softcap)
    out, lse = empty_result(tq, hq, v_cache.shape[-1], q.dtype, q.device)
    table = block_table.tolist()
    for r, n in enumerate(lens):
        q0, q1 = cq[r], cq[r + 1]
        if q1 == q0 or n <= 0:
            continue
        ids = table[r][: (n + block - 1) // block]
        k = gather_paged(k_cache, ids, n)
        v = k[..., : v_cache.shape[-1]] if value_prefix else gather_paged(v_cache, ids, n)
        bound = None if kv_bound is None else kv_bound[q0:q1]
        start = None if kv_start is None else kv_start[q0:q1]
        plain = bound is not None and start is None and not softcap
        if plain and _is_suffix_causal(bound, n):
            o, l_ = attend(q[q0:q1], k, v, scale, causal=True)
        elif plain and len(runs := causal_runs(bound, n) or ()) and len(runs) <= MAX_CAUSAL_RUNS:
            # a few causal runs (a PCP rank's zigzag chunks): each on the causal kernel
            for i0, i1, end in runs:
                out[q0 + i0:q0 + i1], lse[q0 + i0:q0 + i1] = attend(q[q0 + i0:q0 + i1], k[:end], v[:end], scale,
                                                                    causal=True)
            continue
        else:
            o, l_ = attend(q[q0:q1], k, v, scale, kv_bound=bound, kv_start=start, softcap=softcap)
        out[q0:q1] = o
        lse[q0:q1] = l_
    return out, lse


def write_slots(cache: torch.Tensor, new: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """``cache.view(-1, …)[slot_mapping[t]] = new[t]`` in place for every token ``t`` whose slot is
    ``>= 0``; slot −1 (a DCP rank that does not own the token) writes nothing."""
    flat = cache.view(-1, *cache.shape[2:])
    owned = slot_mapping >= 0
    if bool(owned.all()):
        flat.index_copy_(0, slot_mapping.to(torch.int64), new.to(cache.dtype))
    else:
        flat.index_copy_(0, slot_mapping[owned].to(torch.int64), new[owned].to(cache.dtype))


def write_slots_fp8(cache: torch.Tensor, new: torch.Tensor, slot_mapping: torch.Tensor, scales: torch.Tensor) -> None:
    """``new [T, H, D]`` quantised per (token, head, 128-group) (:func:`~dcpgraph.ops.quant.quantize_fp8`)
    and written with its scales into the same slots; slot −1 skips. The native kernel does it in
    one pass where it is enabled (:data:`FP8_WRITE`) and the layouts are dense rows, else
    :func:`_write_fp8_torch`."""
    from . import quant

    if cache.device.type == "cpu" and FP8_WRITE.enabled() and FP8_WRITE.extension.module.kv_cache_write_fp8(
            cache, new, slot_mapping, scales, quant.FP8_SCALE_GROUP, quant.MIN_SCALE_EXP, quant.MAX_SCALE_EXP):
        return
    _write_fp8_torch(cache, new, slot_mapping, scales)


def _write_fp8_torch(cache, new, slot_mapping, scales) -> None:
    from . import quant

    values, token_scales = quant.quantize_fp8(new)
    # as bytes: aten's CPU index_copy_ has no fp8 kernel (the bits are copied unchanged)
    write_slots(cache.view(torch.uint8), values.view(torch.uint8), slot_mapping)
    write_slots(scales, token_scales, slot_mapping)


def _fp8_write_check(module) -> str | None:
    """The native fp8 write against :func:`_write_fp8_torch`, bytes and scales bit for bit: an
    all-zero group, a NaN, an infinity, magnitudes 1e-30…1e30, a short last group, slot −1."""
    from . import quant

    gen = torch.Generator().manual_seed(77)
    for heads, d, dtype in ((2, 200, torch.float32), (1, 576, torch.bfloat16), (3, 64, torch.float16)):
        new = torch.randn(6, heads, d, generator=gen) * torch.logspace(-30, 30, 6).view(6, 1, 1)
        new[1, 0, :128] = 0.0
        new[2, 0, 5] = float("nan")
        new[3, -1, 7] = float("inf")
        new = new.to(dtype)
        slots = torch.tensor([3, -1, 0, 9, 4, 7])
        caches = [torch.zeros(3, 4, heads, d, dtype=quant.FP8_DTYPE) for _ in range(2)]
        scales = [torch.zeros(3, 4, heads, quant.scale_groups(d)) for _ in range(2)]
        wrote = module.kv_cache_write_fp8(caches[0], new, slots, scales[0], quant.FP8_SCALE_GROUP,
                                          quant.MIN_SCALE_EXP, quant.MAX_SCALE_EXP)
        _write_fp8_torch(caches[1], new, slots, scales[1])
        if not (wrote and torch.equal(caches[0].view(torch.uint8), caches[1].view(torch.uint8))
                and torch.equal(scales[0], scales[1])):
            return "the native fp8 cache write failed its self-check against quantize_fp8"
    return None


# fp8 cache writes quantise natively (the paged extension's kv_cache_write_fp8) once it passed
# _fp8_write_check in this process; ``FP8_WRITE.reason`` says why not.
FP8_WRITE = SelfCheckedKernel(native.EXTENSION, _fp8_write_check)
