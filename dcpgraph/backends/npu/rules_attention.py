"""``paged_attention`` and ``partial_attention`` → FusedInferAttentionScore (FIAS), TND layout.

FIAS (torchair's ``air::npu_fused_infer_attention_score``, see :func:`.ascend.fias_op`) with
``input_layout="TND"``: queries ``[T, N, D]`` packed over requests, ``actual_seq_lengths`` the
cumulative query ends (``cu_seqlens_q[1:]``), ``softmax_lse_flag=True`` for an lse ``[T, N, 1]``
(natural log, fp32) that becomes dcpgraph's ``[T, N]``. MLA (values a prefix ``[..., :R]`` of the
latent key): ``query``/``key``/``value`` are the ``R`` latent dims, ``query_rope``/``key_rope``
the rest.

Limits of the kernel, not checked by conversion (they would fail in CANN's compile on the
device): query fp16/bf16 (fp32 converts but is not listed as supported; fp64 is refused here),
``num_heads / num_key_value_heads`` ≤ 64, paged ``block_size`` a multiple of 128 in [128, 512]
for GQA (MLA: 128), MLA only with latent 512 + rope 64 and one KV head (DeepSeek's shapes;
dcpgraph's tiny test models use 32 + 8), A2/A3 hardware.

Unverified without Ascend hardware: FIAS's numerics; that TND ``actual_seq_lengths_kv`` is
per-request for paged KV and cumulative without paging (as its documentation describes); that
non-paged TND accepts ``query_rope``; and the cost of the MLA cache being one tensor
``[c ‖ k_rope]``: the ``c``/``k_rope`` slices are strided views GE may copy whole each step
(vLLM-Ascend keeps two caches for this reason).
"""

from __future__ import annotations

import torch
import torch.fx

from ...ops.merge import NEG_INF
from .ascend import fias_op
from .rules import Site, register, value_of

aten = torch.ops.aten
dcp_ops = torch.ops.dcpgraph

FIAS_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FIAS_MASK_SIZE = 2048  # sparse_mode 3 takes a fixed 2048×2048 upper-triangular mask

_VIEW_OPS = {
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.transpose.int,
    aten.permute.default, aten.select.int, aten.unsqueeze.default, aten.squeeze.dim,
    aten.expand.default, aten.alias.default, aten.clone.default, aten.contiguous.default,
}


# -- checkers and params ---------------------------------------------------------------------------
def _strip_views(node):
    while isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in _VIEW_OPS:
        node = node.args[0]
    return node


def latent_prefix(k: torch.fx.Node, v: torch.fx.Node) -> int:
    """``R`` when ``v`` is ``k[..., :R]`` up to the same leading-dim views (MLA's latent cache),
    else 0."""
    kv, vv = value_of(k), value_of(v)
    if kv.shape[:-1] != vv.shape[:-1] or vv.shape[-1] >= kv.shape[-1]:
        return 0
    node = v
    while isinstance(node, torch.fx.Node) and node.op == "call_function":
        if node.target is aten.slice.Tensor:
            src = node.args[0]
            dim = node.args[1] if len(node.args) > 1 else 0
            start = node.args[2] if len(node.args) > 2 else 0
            if dim in (-1, value_of(src).dim() - 1) and start in (0, None) and _strip_views(src) is _strip_views(k):
                return int(vv.shape[-1])
            return 0
        if node.target not in _VIEW_OPS:
            return 0
        node = node.args[0]
    return 0


def _fias_dtype(q: torch.Tensor) -> str | None:
    if q.dtype not in FIAS_DTYPES:
        return f"FusedInferAttentionScore has no {q.dtype} form (build the program in bf16/fp16)"
    return None


def _modifiers(site: Site, first: int) -> str | None:
    """A sliding window or a logit soft-cap (the op's optional arguments from ``first`` on) is not
    lowered to FIAS here: refused with the reason rather than dropped."""
    window, softcap = (tuple(site.args[first:first + 2]) + (None, None))[:2]
    if (window is not None and not (isinstance(window, int) and window == 0)) or softcap:
        return "a sliding window or logit soft-cap is not lowered to FIAS (no rule maps it yet)"
    return None


def _paged_applies(site: Site) -> str | None:
    if (reason := _modifiers(site, 8)) is not None:
        return reason
    if len(site.args) > 10 or site.args[1].dtype == torch.float8_e4m3fn:
        # torch-npu 2.13's FIAS documentation lists int8 and int4 keys/values for its quantised-KV
        # ("antiquant") inputs on Atlas A2/A3, not float8_e4m3fn, so there is no Ascend op to map
        # dcpgraph's e4m3 blocks and per-(token, head, 128-group) scales onto.
        return ("an fp8 KV cache (kv_cache_dtype='fp8_e4m3') has no lowering: FusedInferAttentionScore "
                "reads quantised KV as int8/int4 only on Atlas A2/A3 (torch-npu 2.13); compile with "
                "kv_cache_dtype='auto' or 'bf16' for Ascend")
    if site.args[6] is not None:
        return "kv_bound (a per-query causal bound inside the cache) has no FIAS form"
    return _fias_dtype(site.args[0])


def _paged_mla_applies(site: Site) -> str | None:
    if not latent_prefix(site.node.args[1], site.node.args[2]):
        return "the values are not a prefix of the keys (no MLA latent cache)"
    return _paged_applies(site)


def _partial_applies(site: Site) -> str | None:
    return _modifiers(site, 7) or _fias_dtype(site.args[0])


def _partial_mla_applies(site: Site) -> str | None:
    if not latent_prefix(site.node.args[1], site.node.args[2]):
        return "the values are not a prefix of the keys (no MLA latent cache)"
    return _partial_applies(site)


def _common_params(site: Site, keys: torch.Tensor, heads_dim: int) -> dict:
    return {"num_heads": int(site.args[0].shape[1]), "kv_heads": int(keys.shape[heads_dim]),
            "out_dtype": site.output(0).dtype, "lse_dtype": site.output(1).dtype}


def _paged_params(site: Site) -> dict:
    k_cache = site.args[1]
    return {**_common_params(site, k_cache, 2), "block_size": int(k_cache.shape[1])}


def _paged_mla_params(site: Site) -> dict:
    return {**_paged_params(site), "latent": latent_prefix(site.node.args[1], site.node.args[2])}


def _partial_params(site: Site) -> dict:
    return _common_params(site, site.args[1], 1)


def _partial_mla_params(site: Site) -> dict:
    return {**_partial_params(site), "latent": latent_prefix(site.node.args[1], site.node.args[2])}


# -- lowerings -------------------------------------------------------------------------------------
def _fias(query, key, value, *, out_dtype, lse_dtype, **options):
    """FIAS in TND with the lse requested; ``(out, lse [T, N])`` in the op's dtypes."""
    out, lse = fias_op()(query, key, value, input_layout="TND", softmax_lse_flag=True, **options)
    return out.to(out_dtype), lse.squeeze(-1).to(lse_dtype)


def _mask_empty_rows(out, lse, q, cu_seqlens_q, kv_lens):
    """Rows whose request has no (local) key: ``(0, −inf)``, the merge's neutral element, whatever
    FIAS returns for them (undocumented)."""
    # positions 0..T-1 on q's device (an arange would bake the tracing device into the graph)
    ones = torch.ones_like(q.select(-1, 0).select(-1, 0), dtype=torch.int64)  # [T]
    positions = ones.cumsum(0) - ones
    ends = cu_seqlens_q[1:].to(torch.int64)
    row = (positions.unsqueeze(1) >= ends.unsqueeze(0)).to(torch.int64).sum(1)  # request of each token
    has_keys = kv_lens.index_select(0, row) > 0  # [T]
    return torch.where(has_keys.view(-1, 1, 1), out, 0.0), torch.where(has_keys.view(-1, 1), lse, NEG_INF)


def paged_attention_fias(q, k_cache, v_cache, block_table, cu_seqlens_q, kv_lens, kv_bound, scale, *,
                         num_heads, kv_heads, block_size, out_dtype, lse_dtype, latent=0):
    """Paged FIAS: the cache ``[NB, B, Hkv, D]`` viewed ``[NB, B, Hkv·D]``, ``block_table`` int32,
    ``block_size=B``, ``actual_seq_lengths_kv`` the (local) context length of each request.

    ``kv_bound`` is always None here (the checker refuses it).
    """
    options = dict(
        actual_seq_lengths=cu_seqlens_q[1:].to(torch.int64), actual_seq_lengths_kv=kv_lens.to(torch.int64),
        block_table=block_table.to(torch.int32), scale=float(scale), num_heads=num_heads,
        num_key_value_heads=kv_heads, block_size=block_size, sparse_mode=0,
        out_dtype=out_dtype, lse_dtype=lse_dtype,
    )
    if latent:
        c = k_cache[..., :latent].flatten(2)
        out, lse = _fias(q[..., :latent], c, c, query_rope=q[..., latent:],
                         key_rope=k_cache[..., latent:].flatten(2), **options)
    else:
        out, lse = _fias(q, k_cache.flatten(2), v_cache.flatten(2), **options)
    return _mask_empty_rows(out, lse, q, cu_seqlens_q, kv_lens)


def partial_attention_fias(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal, *,
                           num_heads, kv_heads, out_dtype, lse_dtype, latent=0):
    """Contiguous-KV FIAS: ``actual_seq_lengths_kv`` = ``cu_seqlens_k[1:]``; ``causal`` →
    ``sparse_mode=3`` (bottom-right causal) with the 2048×2048 upper-triangular mask it requires."""
    options = dict(
        actual_seq_lengths=cu_seqlens_q[1:].to(torch.int64),
        actual_seq_lengths_kv=cu_seqlens_k[1:].to(torch.int64),
        scale=float(scale), num_heads=num_heads, num_key_value_heads=kv_heads,
        out_dtype=out_dtype, lse_dtype=lse_dtype,
    )
    if causal:
        mask = q.new_ones([FIAS_MASK_SIZE, FIAS_MASK_SIZE], dtype=torch.bool).triu(1)
        options.update(sparse_mode=3, atten_mask=mask)
    else:
        options.update(sparse_mode=0)
    if latent:
        c = k[..., :latent]
        return _fias(q[..., :latent], c, c, query_rope=q[..., latent:], key_rope=k[..., latent:], **options)
    return _fias(q, k, v, **options)


# MLA first: its checker is the stricter one.
register(dcp_ops.paged_attention.default, "paged_attention(mla)->FIAS", checker=_paged_mla_applies,
         params=_paged_mla_params, uses="npu")(paged_attention_fias)
register(dcp_ops.paged_attention.default, "paged_attention->FIAS", checker=_paged_applies,
         params=_paged_params, uses="npu")(paged_attention_fias)
register(dcp_ops.partial_attention.default, "partial_attention(mla)->FIAS", checker=_partial_mla_applies,
         params=_partial_mla_params, uses="npu")(partial_attention_fias)
register(dcp_ops.partial_attention.default, "partial_attention->FIAS", checker=_partial_applies,
         params=_partial_params, uses="npu")(partial_attention_fias)
