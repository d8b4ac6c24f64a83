"""Reference CPU kernels of partial attention: ``(out, lse)`` over a contiguous KV (the paged reads
and the native-kernel dispatch are in :mod:`.paged`, which builds on these).

Shapes (token-major, as in a flattened continuous batch):

- ``q`` ``[T, Hq, D]``; keys ``[S, Hkv, D]``; values ``[S, Hkv, Dv]``; ``Hq % Hkv == 0`` and query
  head ``h`` reads KV head ``h // (Hq // Hkv)`` (GQA grouping);
- ``out`` ``[T, Hq, Dv]`` in ``q``'s dtype; ``lse`` ``[T, Hq]`` natural log, fp32 (fp64 for fp64
  inputs: see :func:`acc_dtype`);
- a query row with no visible key gets ``out = 0`` and ``lse = −inf`` (the merge's neutral state).

Two score modifiers are supported by every kernel here (and force the math path): ``softcap > 0``
replaces each score ``s`` (already scaled) by ``c·tanh(s/c)`` before the softmax (Gemma2's
``attn_logit_softcapping``), and a sliding ``window > 0`` keeps key ``j`` for query ``i`` only if
``pos(i) − W < pos(j)`` (HF's ``sliding_window_overlay``), given either as a window over aligned
positions (``attend``/varlen) or, for paged reads (:mod:`.paged`), as a per-query local lower
bound ``kv_start``.

The fast path is aten's CPU flash kernel (``_scaled_dot_product_flash_attention_for_cpu``), which
returns the LSE; it is used when q/k/v share a head size, the key set is non-empty (the kernel
raises SIGFPE on zero keys) and the mask is none or a square causal one. Everything else takes an
fp32 math path. Both read K/V through strided views: a run of consecutive physical blocks in a
paged cache is a view, not a copy.
"""

from __future__ import annotations

import torch

from .merge import merge_attention_reference

NEG_INF = float("-inf")


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """LSE and accumulation dtype: fp32, or fp64 for fp64 inputs (never below fp32)."""
    return torch.promote_types(dtype, torch.float32)


def empty_result(tq: int, hq: int, dv: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.zeros(tq, hq, dv, dtype=dtype, device=device),
        torch.full((tq, hq), NEG_INF, dtype=acc_dtype(dtype), device=device),
    )


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    *,
    causal: bool = False,
    kv_bound: torch.Tensor | None = None,
    kv_start: torch.Tensor | None = None,
    window: int = 0,
    softcap: float = 0.0,
    chunk: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q [Lq, Hq, D]`` over ``k [Lk, Hkv, D]``, ``v [Lk, Hkv, Dv]`` → ``(out, lse)``.

    ``causal``: bottom-right aligned (query ``i`` sees keys ``j <= Lk − Lq + i``).
    ``kv_bound [Lq]``: query ``i`` sees keys ``j < kv_bound[i]`` only (a causal bound by global
    position, translated to local key indices by the caller).
    ``kv_start [Lq]``: query ``i`` sees keys ``j >= kv_start[i]`` only (a sliding window's lower
    bound in local key indices). ``window`` (with ``causal``): query ``i`` sees keys
    ``j > Lk − Lq + i − window``. ``chunk`` (with ``causal``, aligned positions ``p = Lk − Lq + i``):
    query ``i`` sees keys ``j >= ⌊p/chunk⌋·chunk`` only. ``softcap``: scores become
    ``softcap·tanh(s/softcap)``.
    """
    lq, hq, _ = q.shape
    lk, hkv, dv = v.shape
    if lq == 0:
        return empty_result(0, hq, dv, q.dtype, q.device)
    if lk == 0:
        return empty_result(lq, hq, dv, q.dtype, q.device)
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    if kv_start is not None or window or softcap or chunk:
        return _attend_math(q, k, v, scale, causal=causal, kv_bound=kv_bound, kv_start=kv_start, window=window,
                            softcap=softcap, chunk=chunk)
    value_prefix = is_prefix_view(v, k)
    flash_dtype = q.dtype == k.dtype == v.dtype and q.dtype in _FLASH_DTYPES
    if kv_bound is None and not causal and flash_dtype and (q.shape[-1] == k.shape[-1] == dv or value_prefix):
        return _attend_grouped_flash(q, k, k if value_prefix else v, scale, dv)
    if causal and kv_bound is None and lk > lq:
        # Bottom-right causal: every query sees the first lk − lq keys fully, then a causal square.
        head = attend(q, k[: lk - lq], v[: lk - lq], scale)
        tail = attend(q, k[lk - lq :], v[lk - lq :], scale, causal=True)
        return merge_attention_reference(torch.stack([head[0], tail[0]]), torch.stack([head[1], tail[1]]))
    if (kv_bound is not None and not causal and flash_dtype and lq > BOUND_TILE_QUERIES
            and (q.shape[-1] == k.shape[-1] == dv or value_prefix) and is_non_decreasing(kv_bound)):
        return _attend_bounded_tiles(q, k, v, scale, kv_bound)
    if kv_bound is None and flash_dtype and q.shape[-1] == k.shape[-1] == dv and (not causal or lq == lk):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.transpose(0, 1).unsqueeze(0),
            k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0),
            0.0,
            causal,
            scale=scale,
        )[:2]
        return out[0].transpose(0, 1), lse[0].transpose(0, 1).to(acc_dtype(q.dtype))
    return _attend_math(q, k, v, scale, causal=causal, kv_bound=kv_bound)


_FLASH_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
BOUND_TILE_QUERIES = 128


def is_non_decreasing(bound: torch.Tensor) -> bool:
    return bound.numel() < 2 or bool((bound[1:] >= bound[:-1]).all())


def _attend_bounded_tiles(q, k, v, scale, kv_bound):
    """Attention under a non-decreasing ``kv_bound`` (a DCP or PCP rank's local keys of a prefill
    chunk: query ``i`` sees ``j < kv_bound[i]``, which rises by about ``1/dcp`` key per query).

    Queries go in tiles of :data:`BOUND_TILE_QUERIES`. In tile ``[i0, i1)`` every query sees keys
    ``[0, lo)`` with ``lo = kv_bound[i0]`` (clamped to ``[0, Lk]``), so that part is unmasked
    attention on the flash kernel; only the band ``[lo, hi)`` with ``hi = kv_bound[i1 − 1]`` needs a
    mask (``j − lo < kv_bound[i] − lo``), on the math path. The two partials are merged by LSE
    (:func:`~dcpgraph.ops.merge.merge_attention_reference`), which is exact. The masked work is
    ``O(tile · band)`` per tile instead of ``O(Lq · Lk)`` for the whole chunk."""
    lq, hq, _ = q.shape
    lk, _, dv = v.shape
    out, lse = empty_result(lq, hq, dv, q.dtype, q.device)
    bounds = kv_bound.clamp(0, lk).tolist()
    for i0 in range(0, lq, BOUND_TILE_QUERIES):
        i1 = min(lq, i0 + BOUND_TILE_QUERIES)
        lo, hi = bounds[i0], bounds[i1 - 1]
        parts = []
        if lo > 0:
            parts.append(attend(q[i0:i1], k[:lo], v[:lo], scale))
        if hi > lo:
            band = kv_bound[i0:i1].to(torch.int64) - lo
            parts.append(_attend_math(q[i0:i1], k[lo:hi], v[lo:hi], scale, causal=False, kv_bound=band))
        if len(parts) == 1:
            out[i0:i1], lse[i0:i1] = parts[0]
        elif parts:
            merged, merged_lse = merge_attention_reference(torch.stack([parts[0][0], parts[1][0]]),
                                                           torch.stack([parts[0][1], parts[1][1]]))
            out[i0:i1], lse[i0:i1] = merged.to(q.dtype), merged_lse
    return out, lse


def is_prefix_view(v: torch.Tensor, k: torch.Tensor) -> bool:
    """``v`` is ``k[..., :Dv]`` (MLA's latent cache: values are the first R dims of the key)."""
    return (
        v.shape[-1] < k.shape[-1] and v.shape[:-1] == k.shape[:-1] and v.stride() == k.stride()
        and v.data_ptr() == k.data_ptr() and v.dtype == k.dtype
    )


def _attend_grouped_flash(q, k, v, scale, dv):
    """Non-causal attention with the ``G = Hq/Hkv`` query heads of each KV head as extra query
    rows: ``[Lq, Hkv·G, D] → [1, Hkv, G·Lq, D]`` against ``[1, Hkv, Lk, D]``. Exact (no mask ties a
    row to a position), and the kernel streams each KV head once instead of once per query head,
    which is what makes decode attention bandwidth-bound rather than G× slower. ``v`` may be wider
    than ``dv`` (MLA passes the key itself); the output keeps the first ``dv`` dims."""
    lq, hq, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    rows = q.reshape(lq, hkv, group, d).permute(1, 2, 0, 3).reshape(1, hkv, group * lq, d)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        rows, k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0), 0.0, False, scale=scale
    )[:2]
    out = out[0, :, :, :dv].reshape(hkv, group, lq, dv).permute(2, 0, 1, 3).reshape(lq, hq, dv)
    lse = lse[0].reshape(hkv, group, lq).permute(2, 0, 1).reshape(lq, hq)
    return out, lse.to(acc_dtype(q.dtype))


def soft_cap(scores: torch.Tensor, softcap: float) -> torch.Tensor:
    """``c·tanh(s/c)`` for ``c > 0``; the scores unchanged for ``c == 0``."""
    return torch.tanh(scores / softcap) * softcap if softcap else scores


def softmax_attend(scores: torch.Tensor, values: torch.Tensor, visible: torch.Tensor | None):
    """``(softmax(scores)·values, logsumexp(scores))`` over the last axis, keys outside ``visible``
    masked; a row that sees no key gives ``(0, −inf)``, never NaN."""
    if visible is not None:
        scores = scores.masked_fill(~visible, NEG_INF)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - torch.where(lse == NEG_INF, 0.0, lse).unsqueeze(-1))
    return torch.matmul(probs, values), lse


def _attend_math(q, k, v, scale, *, causal, kv_bound, kv_start=None, window=0, softcap=0.0, chunk=0):
    lq, hq, _ = q.shape
    lk, hkv, _ = v.shape
    group = hq // hkv
    acc = acc_dtype(q.dtype)
    qf = q.to(acc).reshape(lq, hkv, group, -1).permute(1, 2, 0, 3)  # [Hkv, G, Lq, D]
    kf = k.to(acc).permute(1, 2, 0).unsqueeze(1)  # [Hkv, 1, D, Lk]
    vf = v.to(acc).permute(1, 0, 2).unsqueeze(1)  # [Hkv, 1, Lk, Dv]
    scores = soft_cap(torch.matmul(qf, kf) * scale, softcap)  # [Hkv, G, Lq, Lk]
    keys = torch.arange(lk, device=q.device)
    diagonal = (lk - lq + torch.arange(lq, device=q.device)).unsqueeze(1)  # aligned query positions
    masks = []
    if causal:
        masks.append(keys.unsqueeze(0) <= diagonal)
        if window:
            masks.append(keys.unsqueeze(0) > diagonal - window)
        if chunk:
            masks.append(keys.unsqueeze(0) >= torch.div(diagonal, chunk, rounding_mode="floor") * chunk)
    if kv_bound is not None:
        masks.append(keys.unsqueeze(0) < kv_bound.to(keys.device).unsqueeze(1))
    if kv_start is not None:
        masks.append(keys.unsqueeze(0) >= kv_start.to(keys.device).unsqueeze(1))
    visible = None
    for mask in masks:
        visible = mask if visible is None else visible & mask
    out, lse = softmax_attend(scores, vf, visible)  # [Hkv, G, Lq, Dv], [Hkv, G, Lq]
    out = out.permute(2, 0, 1, 3).reshape(lq, hq, -1)
    lse = lse.permute(2, 0, 1).reshape(lq, hq)
    return out.to(q.dtype), lse


def _one_key_per_row(q, k, v, scale, softcap=0.0):
    """Every row is one query over exactly one key (decode's new-token part): the softmax weight
    is 1, so ``out = v`` (per GQA group) and ``lse = softcap(scale·q·k)`` — no kernel call per
    request. A sliding window (at least 1) always keeps a query's own key."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    acc = acc_dtype(q.dtype)
    kg = k.to(acc).repeat_interleave(hq // hkv, dim=1)
    lse = soft_cap((q.to(acc) * kg).sum(-1) * scale, softcap)
    out = v.repeat_interleave(hq // hkv, dim=1).to(q.dtype)
    return out, lse


def varlen_partial_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    scale: float,
    causal: bool,
    window: int = 0,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row ``r``'s queries ``q[cq_r:cq_{r+1}]`` attend to keys ``k[ck_r:ck_{r+1}]`` (``window`` and
    ``softcap`` as in :func:`attend`)."""
    tq, hq, _ = q.shape
    cq = cu_seqlens_q.tolist()
    ck = cu_seqlens_k.tolist()
    if cq == ck == list(range(tq + 1)) and tq == k.shape[0]:
        return _one_key_per_row(q, k, v, scale, softcap)
    out, lse = empty_result(tq, hq, v.shape[-1], q.dtype, q.device)
    for r in range(len(cq) - 1):
        q0, q1, k0, k1 = cq[r], cq[r + 1], ck[r], ck[r + 1]
        if q1 == q0 or k1 == k0:
            continue
        o, l_ = attend(q[q0:q1], k[k0:k1], v[k0:k1], scale, causal=causal, window=window, softcap=softcap)
        out[q0:q1] = o
        lse[q0:q1] = l_
    return out, lse
