"""dcpgraph's canonical ops, in the ``torch.ops.dcpgraph`` namespace.

Each op has a reference CPU kernel and a fake kernel, so graphs that use them trace, verify with
fake tensors, compile with inductor, and lower (torchair's ``npugraph_ex`` needs only the fakes; GE
mode gets them rewritten to Ascend ops first).

=====================================  =========================================================
op                                     meaning
=====================================  =========================================================
``attention(q,k,v,scale,causal)``      canonical attention from a front end, HF layout
                                       ``[B, H, S, D]``; causal is top-left (``Sq == Sk``)
``partial_attention(q,k,v,cu_q,cu_k,   varlen attention over contiguous KV → ``(out, lse)``;
scale,causal)``                        causal is bottom-right per row
``paged_attention(q,kc,vc,table,cu_q,  attention over a paged KV cache → ``(out, lse)``,
kv_lens,kv_bound,scale)``              ``kv_lens`` local per row, optional causal bound per query
``merge_attention(outs,lses)``         exact N-way LSE merge (see :mod:`dcpgraph.ops.merge`)
``rescale_to_global(out,lse,lses)``    AG+RS merge's local step
``kv_cache_write_(cache,new,slots)``   in-place write of new K/V into their slots; slot −1 skips
=====================================  =========================================================
"""

from __future__ import annotations

import torch

from . import kernels
from .kernels import acc_dtype
from .merge import merge_attention_reference, rescale_to_global_reference

NS = "dcpgraph"


@torch.library.custom_op(f"{NS}::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    b, hq, s, _ = q.shape
    outs = []
    for i in range(b):
        o, _ = kernels.attend(q[i].transpose(0, 1), k[i].transpose(0, 1), v[i].transpose(0, 1), scale, causal=causal)
        outs.append(o.transpose(0, 1))
    return torch.stack(outs).contiguous()


@attention.register_fake
def _(q, k, v, scale, causal):
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


@torch.library.custom_op(f"{NS}::partial_attention", mutates_args=())
def partial_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    scale: float,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = kernels.varlen_partial_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal)
    return out.contiguous(), lse.contiguous()


@partial_attention.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal):
    return q.new_empty((*q.shape[:-1], v.shape[-1])), q.new_empty(q.shape[:-1], dtype=acc_dtype(q.dtype))


@torch.library.custom_op(f"{NS}::paged_attention", mutates_args=())
def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    kv_lens: torch.Tensor,
    kv_bound: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = kernels.paged_partial_attention(
        q, k_cache, v_cache, block_table, cu_seqlens_q, kv_lens, kv_bound, scale
    )
    return out.contiguous(), lse.contiguous()


@paged_attention.register_fake
def _(q, k_cache, v_cache, block_table, cu_seqlens_q, kv_lens, kv_bound, scale):
    return (
        q.new_empty((*q.shape[:-1], v_cache.shape[-1])),
        q.new_empty(q.shape[:-1], dtype=acc_dtype(q.dtype)),
    )


@torch.library.custom_op(f"{NS}::merge_attention", mutates_args=())
def merge_attention(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return merge_attention_reference(outs, lses)


@merge_attention.register_fake
def _(outs, lses):
    return outs.new_empty(outs.shape[1:]), lses.new_empty(lses.shape[1:], dtype=acc_dtype(lses.dtype))


@torch.library.custom_op(f"{NS}::rescale_to_global", mutates_args=())
def rescale_to_global(
    out: torch.Tensor, lse: torch.Tensor, lses_all: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return rescale_to_global_reference(out, lse, lses_all)


@rescale_to_global.register_fake
def _(out, lse, lses_all):
    acc = torch.promote_types(acc_dtype(lses_all.dtype), out.dtype)
    return out.new_empty(out.shape, dtype=acc), lse.new_empty(lse.shape, dtype=acc_dtype(lses_all.dtype))


@torch.library.custom_op(f"{NS}::kv_cache_write_", mutates_args=("cache",))
def kv_cache_write_(cache: torch.Tensor, new: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    flat = cache.view(-1, *cache.shape[2:])
    owned = slot_mapping >= 0
    if bool(owned.all()):
        flat.index_copy_(0, slot_mapping.to(torch.int64), new.to(cache.dtype))
    else:
        flat.index_copy_(0, slot_mapping[owned].to(torch.int64), new[owned].to(cache.dtype))


@kv_cache_write_.register_fake
def _(cache, new, slot_mapping):
    return None
