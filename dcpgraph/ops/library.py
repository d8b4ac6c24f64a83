"""dcpgraph's canonical ops, in the ``torch.ops.dcpgraph`` namespace.

Each op has a reference CPU kernel and a fake kernel, so graphs that use them trace, verify with
fake tensors, compile with inductor, and lower (torchair's ``npugraph_ex`` needs only the fakes; GE
mode gets them rewritten to Ascend ops first).

=====================================  =========================================================
op                                     meaning
=====================================  =========================================================
``attention(q,k,v,scale,causal,        canonical attention from a front end, HF layout
window,softcap,sinks,chunk)``          ``[B, H, S, D]``; causal is top-left (``Sq == Sk``)
``partial_attention(q,k,v,cu_q,cu_k,   varlen attention over contiguous KV → ``(out, lse)``;
scale,causal,window,softcap)``         causal is bottom-right per row
``paged_attention(q,kc,vc,table,cu_q,  attention over a paged KV cache → ``(out, lse)``,
kv_lens,kv_bound,scale,kv_start,       ``kv_lens`` local per row, optional causal bound and
softcap,k_scales?,v_scales?)``        window start (local key index) per query; with scales
                                       the caches are fp8 (:mod:`dcpgraph.ops.quant`)
``merge_attention(outs,lses)``         exact N-way LSE merge (see :mod:`dcpgraph.ops.merge`)
``rescale_to_global(out,lse,lses)``    AG+RS merge's local step
``kv_cache_write_(cache,new,slots)``   in-place write of new K/V into their slots; slot −1 skips
``kv_cache_write_fp8_(cache,new,       the same into an fp8 cache, quantised with one fp32 scale
slots,scales)``                        per (token, head, 128 elements) written to ``scales``
``linear_bf16(input,weight,bias?)``     ``aten.linear``'s meaning; bf16 CPU calls of few rows run
                                       natively (:mod:`dcpgraph.ops.linear`)
``linear_f32(input,weight,bias?)``      the same for fp32 (:mod:`dcpgraph.ops.linear_f32`)
``rms_norm_bf16(x, weight, eps)``      HF's RMSNorm of a bf16 tensor, one op (:mod:`dcpgraph.ops.rms_norm`)
``rms_norm_f32(x, weight, eps)``       the same for fp32 (:mod:`dcpgraph.ops.rms_norm_f32`)
``rotary_embedding(x, cos, sin)``      HF's ``x·cos + rotate_half(x)·sin``, one op (:mod:`dcpgraph.ops.rotary`)
``mla_preprocess(x, weights…, w_uk,    MLA's query/KV projections, norms, rotary and latent cache
rotary, rotary_sin, cache, slots,      write in one op → ``(q_lat, kv, q_c)``
q_eps, kv_eps, rotary_kind)``          (:mod:`dcpgraph.ops.mla_preprocess`)
=====================================  =========================================================

Score modifiers (defaults mean "off", and passes emit them only when on, so a graph without them
is unchanged): ``window > 0`` is a sliding window (query at ``p`` sees keys at ``p − W < j <= p``),
``chunk > 0`` is chunked (block-local) attention (canonical op only: query at ``p`` sees keys at
``⌊p/C⌋·C <= j <= p``; the cached form bounds its paged read by that chunk start), ``softcap > 0`` caps each scaled score to ``c·tanh(s/c)``, and ``sinks [H]`` (canonical op only)
adds one learned logit per head to the softmax denominator: ``out·σ(lse − sink)`` with
``lse' = logaddexp(lse, sink)``, i.e. a merge with one extra partial ``(0, sink)``.
"""

from __future__ import annotations

import torch

from . import (
    kernels,
    linear,
    linear_f32,
    merge_native,
    mla_preprocess,
    paged,
    quant,
    rms_norm,
    rms_norm_f32,
    rotary,
)
from .kernels import acc_dtype
from .merge import merge_attention_reference, rescale_to_global_reference

NS = "dcpgraph"

# Registered with the low-level ``torch.library.Library`` API (schema + CompositeExplicitAutograd
# kernel + fake), not ``torch.library.custom_op``: the latter wraps every call in autograd and
# dynamo-disable frames costing ~100 µs per call, which at 5 ops per layer was half of a small
# model's decode step. These ops are inference-only (no autograd formula).
_lib = torch.library.Library(NS, "DEF")
_SCHEMAS = {
    "attention": (
        "attention(Tensor q, Tensor k, Tensor v, float scale, bool causal, int window=0, "
        "float softcap=0.0, Tensor? sinks=None, int chunk=0) -> Tensor"
    ),
    "partial_attention": (
        "partial_attention(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
        "float scale, bool causal, int window=0, float softcap=0.0) -> (Tensor, Tensor)"
    ),
    "paged_attention": (
        "paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, "
        "Tensor cu_seqlens_q, Tensor kv_lens, Tensor? kv_bound, float scale, Tensor? kv_start=None, "
        "float softcap=0.0, Tensor? k_scales=None, Tensor? v_scales=None) -> (Tensor, Tensor)"
    ),
    "merge_attention": "merge_attention(Tensor outs, Tensor lses) -> (Tensor, Tensor)",
    "rescale_to_global": "rescale_to_global(Tensor out, Tensor lse, Tensor lses_all) -> (Tensor, Tensor)",
    "kv_cache_write_": "kv_cache_write_(Tensor(a!) cache, Tensor new, Tensor slot_mapping) -> ()",
    "kv_cache_write_fp8_": (
        "kv_cache_write_fp8_(Tensor(a!) cache, Tensor new, Tensor slot_mapping, Tensor(b!) scales) -> ()"
    ),
    "mla_preprocess": (
        "mla_preprocess(Tensor x, Tensor? q_a_weight, Tensor? q_a_norm_weight, Tensor q_b_weight, "
        "Tensor kv_a_weight, Tensor kv_norm_weight, Tensor w_uk, Tensor rotary, Tensor? rotary_sin, "
        "Tensor(a!) cache, Tensor slot_mapping, float q_eps, float kv_eps, str rotary_kind) "
        "-> (Tensor, Tensor, Tensor)"
    ),
    "linear_bf16": "linear_bf16(Tensor input, Tensor weight, Tensor? bias=None) -> Tensor",
    "linear_f32": "linear_f32(Tensor input, Tensor weight, Tensor? bias=None) -> Tensor",
    "rms_norm_bf16": "rms_norm_bf16(Tensor x, Tensor weight, float eps) -> Tensor",
    "rms_norm_f32": "rms_norm_f32(Tensor x, Tensor weight, float eps) -> Tensor",
    "rotary_embedding": "rotary_embedding(Tensor x, Tensor cos, Tensor sin) -> Tensor",
}
for _schema in _SCHEMAS.values():
    _lib.define(_schema)


def _register(name: str, kernel, fake) -> None:
    _lib.impl(name, kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NS}::{name}", fake, lib=_lib)


def with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """``out [T, H, Dv]`` with each head's sink logit added to its softmax denominator: the merge
    of ``(out, lse)`` with the partial ``(0, sinks[h])``."""
    sink_lse = sinks.to(lse.dtype).unsqueeze(0).expand_as(lse)
    merged, _ = merge_attention_reference(torch.stack([out, torch.zeros_like(out)]), torch.stack([lse, sink_lse]))
    return merged


def _attention(q, k, v, scale, causal, window=0, softcap=0.0, sinks=None, chunk=0):
    b = q.shape[0]
    outs = []
    for i in range(b):
        o, lse = kernels.attend(
            q[i].transpose(0, 1), k[i].transpose(0, 1), v[i].transpose(0, 1), scale,
            causal=causal, window=window, softcap=softcap, chunk=chunk,
        )
        if sinks is not None:
            o = with_sinks(o, lse, sinks)
        outs.append(o.transpose(0, 1))
    return torch.stack(outs).contiguous()


def _attention_fake(q, k, v, scale, causal, window=0, softcap=0.0, sinks=None, chunk=0):
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


def _partial_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal, window=0, softcap=0.0):
    out, lse = kernels.varlen_partial_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal, window, softcap)
    return out.contiguous(), lse.contiguous()


def _partial_attention_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal, window=0, softcap=0.0):
    return q.new_empty((*q.shape[:-1], v.shape[-1])), q.new_empty(q.shape[:-1], dtype=acc_dtype(q.dtype))


def _paged_attention(q, k_cache, v_cache, block_table, cu_seqlens_q, kv_lens, kv_bound, scale, kv_start=None,
                     softcap=0.0, k_scales=None, v_scales=None):
    if k_scales is None and quant.is_fp8(k_cache.dtype):
        raise ValueError("paged_attention: an fp8 KV cache needs its scales (k_scales, and v_scales unless "
                         "the values are a prefix of the keys)")
    out, lse = paged.paged_partial_attention(  # fp8: the native kernel reads it with its scales
        q, k_cache, v_cache, block_table, cu_seqlens_q, kv_lens, kv_bound, scale, kv_start, softcap,
        k_scales, v_scales,
    )
    return out.contiguous(), lse.contiguous()


def _paged_attention_fake(q, k_cache, v_cache, block_table, cu_seqlens_q, kv_lens, kv_bound, scale, kv_start=None,
                          softcap=0.0, k_scales=None, v_scales=None):
    return (
        q.new_empty((*q.shape[:-1], v_cache.shape[-1])),
        q.new_empty(q.shape[:-1], dtype=acc_dtype(q.dtype)),
    )


def _merge_attention(outs, lses):
    merged = merge_native.merge_attention(outs, lses)  # CPU: one pass in C++ once self-checked
    return merge_attention_reference(outs, lses) if merged is None else merged


def _merge_attention_fake(outs, lses):
    return outs.new_empty(outs.shape[1:]), lses.new_empty(lses.shape[1:], dtype=acc_dtype(lses.dtype))


def _rescale_to_global(out, lse, lses_all):
    scaled = merge_native.rescale_to_global(out, lse, lses_all)  # CPU: the merge's row LSE, in C++
    return rescale_to_global_reference(out, lse, lses_all) if scaled is None else scaled


def _rescale_to_global_fake(out, lse, lses_all):
    acc = torch.promote_types(acc_dtype(lses_all.dtype), out.dtype)
    return out.new_empty(out.shape, dtype=acc), lse.new_empty(lse.shape, dtype=acc_dtype(lses_all.dtype))


def _kv_cache_write_(cache, new, slot_mapping):
    paged.write_slots(cache, new, slot_mapping)


def _kv_cache_write_fake(cache, new, slot_mapping):
    return None


def _kv_cache_write_fp8_(cache, new, slot_mapping, scales):
    """Quantise ``new [T, H, D]`` per (token, head, 128-group) and write values and scales into
    the same slots (scheme and why: :mod:`dcpgraph.ops.quant`); slot −1 skips, as for
    ``kv_cache_write_``. A slot's scale depends only on its own values, so writes commute."""
    paged.write_slots_fp8(cache, new, slot_mapping, scales)


def _kv_cache_write_fp8_fake(cache, new, slot_mapping, scales):
    return None


_register("attention", _attention, _attention_fake)
_register("partial_attention", _partial_attention, _partial_attention_fake)
_register("paged_attention", _paged_attention, _paged_attention_fake)
_register("merge_attention", _merge_attention, _merge_attention_fake)
_register("rescale_to_global", _rescale_to_global, _rescale_to_global_fake)
_register("kv_cache_write_", _kv_cache_write_, _kv_cache_write_fake)
_register("kv_cache_write_fp8_", _kv_cache_write_fp8_, _kv_cache_write_fp8_fake)
_register("mla_preprocess", mla_preprocess.mla_preprocess_reference, mla_preprocess.mla_preprocess_fake)
_register("linear_bf16", linear.linear_bf16, linear.linear_bf16_fake)
_register("linear_f32", linear_f32.linear_f32, linear_f32.linear_f32_fake)
_register("rms_norm_bf16", rms_norm.rms_norm_reference, rms_norm.rms_norm_fake)
_register("rms_norm_f32", rms_norm_f32.rms_norm_f32_reference, rms_norm_f32.rms_norm_f32_fake)
_register("rotary_embedding", rotary.rotary_reference, rotary.rotary_fake)

ops = torch.ops.dcpgraph
attention = ops.attention
partial_attention = ops.partial_attention
paged_attention = ops.paged_attention
merge_attention = ops.merge_attention
rescale_to_global = ops.rescale_to_global
kv_cache_write_ = ops.kv_cache_write_
kv_cache_write_fp8_ = ops.kv_cache_write_fp8_
mla_preprocess_op = ops.mla_preprocess
linear_bf16 = ops.linear_bf16
linear_f32_op = ops.linear_f32
rms_norm_bf16 = ops.rms_norm_bf16
rms_norm_f32_op = ops.rms_norm_f32
rotary_embedding = ops.rotary_embedding
from . import sparse  # noqa: E402,F401  (registers the sparse-attention ops beside these)
