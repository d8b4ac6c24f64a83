"""``mla_preprocess`` → torch_npu's ``npu_kv_rmsnorm_rope_cache`` for the KV side, or aten.

Which fused Ascend ops torchair converts (torch-npu 2.13.0's ``ge_converter/custom/``): the KV side
of the MLA preprocess has one, ``npu_kv_rmsnorm_rope_cache`` (GE ``KvRmsNormRopeCache``: RMSNorm of
``kv[..., :512]``, DeepSeek's interleaved rotary of ``kv[..., 512:]``, scatter into two paged
caches). The whole-preprocess ops (``npu_mla_prolog`` v1–v3, the MLAPO kernel) have no GE converter
in that wheel, so the query side is lowered to aten here (linear, the fp32 norm, the rotary of
:mod:`dcpgraph.ops.mla_preprocess`).

Rules, tried in order:

``mla_preprocess->npu_kv_rmsnorm_rope_cache``
    Where the op's documented limits hold (torch_npu API reference: ``kv`` ``[B, 1, S, 576]`` split
    512 + 64, bf16/fp16, cos/sin ``[B, 1, S, 64]``; the rotary is the interleaved form, output
    halves): ``kv_lora_rank`` 512, rope 64, a bf16/fp16 model, interleaved rotary. The op returns,
    with ``is_output_kv=True``, the normed ``c`` and the roped ``k_pe``; they form dcpgraph's latent
    row ``[c ‖ k_pe]``, written to the one latent cache by the same scatter as ``kv_cache_write_``
    (slot −1 skipped). The op's own two caches (``k_cache`` rope, ``ckv_cache`` nope: vLLM Ascend's
    split layout, not dcpgraph's single latent cache) are one-block scratch tensors written at
    slot 0 and dropped.
``mla_preprocess->aten``
    Anything else: the unfused math, traced (the same functions as the CPU reference), and the
    scatter write.
"""

from __future__ import annotations

import torch

from ...ops.mla_preprocess import ROTARY, rms_norm
from .ascend import _has_op
from .rules import NpuLoweringError, Site, register
from .rules_cache import kv_cache_write_as_scatter

dcp_ops = torch.ops.dcpgraph
KV_RMSNORM_ROPE_DIMS = (512, 64)  # (rms_size, rope_size): the only sizes the op documents
KV_RMSNORM_ROPE_DTYPES = (torch.float16, torch.bfloat16)


def kv_rmsnorm_rope_limits(site: Site) -> str | None:
    """None when ``npu_kv_rmsnorm_rope_cache`` can compute this layer's latent row, else why not."""
    x, kv_a, kv_norm, rotary_kind = site.args[0], site.args[4], site.args[5], site.args[13]
    rank = int(kv_norm.shape[0])
    rope = int(kv_a.shape[0]) - rank
    if rotary_kind != "interleave":
        return f"{rotary_kind} rotary (the op rotates DeepSeek's interleaved pairs)"
    if (rank, rope) != KV_RMSNORM_ROPE_DIMS:
        return f"latent {rank} + rope {rope} (the op takes {KV_RMSNORM_ROPE_DIMS[0]} + {KV_RMSNORM_ROPE_DIMS[1]})"
    if x.dtype not in KV_RMSNORM_ROPE_DTYPES:
        return f"dtype {x.dtype} (the op takes float16 or bfloat16)"
    return None


def kv_rmsnorm_rope_cache_op():
    """``torch.ops.npu.npu_kv_rmsnorm_rope_cache.default`` (registered by libtorch_npu.so)."""
    if not _has_op("npu", "npu_kv_rmsnorm_rope_cache"):
        raise NpuLoweringError(
            "torch.ops.npu.npu_kv_rmsnorm_rope_cache is not registered: it comes from torch_npu "
            "(libtorch_npu.so); import torch_npu on an Ascend machine, or compile with mlapo=False"
        )
    return torch.ops.npu.npu_kv_rmsnorm_rope_cache.default


def _scatter_params(site: Site) -> dict:
    return {"row_shape": tuple(int(d) for d in site.args[9].shape[2:])}


def _query(x, q_a_weight, q_a_norm_weight, q_b_weight, w_uk, q_eps, rope: int):
    """``(q_nope·W_UK [1,H,T,R], q_pe [1,H,T,rope], q_c)`` before the rotary, as the reference."""
    batch, tokens = x.shape[:-1]
    nope = w_uk.shape[1]
    if q_a_weight is None:
        q_c = x.new_empty((0,))
        q = torch.nn.functional.linear(x, q_b_weight)
    else:
        q_c = rms_norm(torch.nn.functional.linear(x, q_a_weight), q_a_norm_weight, q_eps)
        q = torch.nn.functional.linear(q_c, q_b_weight)
    q = q.view(batch, tokens, -1, nope + rope).transpose(1, 2)
    q_nope, q_pe = torch.split(q, [nope, rope], dim=-1)
    return torch.matmul(q_nope, w_uk), q_pe, q_c


@register(dcp_ops.mla_preprocess.default, "mla_preprocess->npu_kv_rmsnorm_rope_cache",
          checker=kv_rmsnorm_rope_limits, params=_scatter_params, uses="npu")
def mla_preprocess_kv_rmsnorm_rope(x, q_a_weight, q_a_norm_weight, q_b_weight, kv_a_weight, kv_norm_weight, w_uk,
                                   rotary, rotary_sin, cache, slot_mapping, q_eps, kv_eps, rotary_kind, *,
                                   row_shape: tuple[int, ...]):
    """KV side through ``npu_kv_rmsnorm_rope_cache`` (see the module docstring), query in aten."""
    rank = kv_norm_weight.shape[0]
    rope = kv_a_weight.shape[0] - rank
    batch, tokens = x.shape[:-1]
    kv_in = torch.nn.functional.linear(x, kv_a_weight).view(batch, 1, tokens, rank + rope)
    cos = rotary.unsqueeze(1)  # [1, 1, T, rope]
    sin = rotary_sin.unsqueeze(1)
    index = slot_mapping.new_zeros((batch * tokens,)).to(torch.int64)  # scratch slot 0
    block = cache.shape[1]
    k_scratch = x.new_zeros((1, block, 1, rope))
    c_scratch = x.new_zeros((1, block, 1, rank))
    _, _, k_pe, c = kv_rmsnorm_rope_cache_op()(
        kv_in, kv_norm_weight, cos, sin, index, k_scratch, c_scratch,
        epsilon=kv_eps, cache_mode="PA", is_output_kv=True,
    )
    kv = torch.cat([c.view(1, 1, -1, rank), k_pe.view(1, 1, -1, rope)], -1)
    q_nope_uk, q_pe, q_c = _query(x, q_a_weight, q_a_norm_weight, q_b_weight, w_uk, q_eps, rope)
    q_pe, _ = ROTARY[rotary_kind](q_pe, q_pe[:, :1], rotary, rotary_sin)  # the key half is unused
    kv_cache_write_as_scatter(cache, kv.select(0, 0).transpose(0, 1), slot_mapping, row_shape=row_shape)
    return torch.cat([q_nope_uk, q_pe], -1), kv, q_c


def _complex_rotary_in_place(q, k, freqs, _unused=None):
    """:func:`~dcpgraph.ops.mla_preprocess.rotary_complex` without its ``.to(device)`` moves
    (no-ops where the tensors already are; a traced lowering must not name a device)."""
    xq = torch.view_as_complex(q.float().reshape(*q.shape[:-1], -1, 2))
    xk = torch.view_as_complex(k.float().reshape(*k.shape[:-1], -1, 2))
    freqs = freqs.unsqueeze(1)
    return (torch.view_as_real(xq * freqs).flatten(3).type_as(q),
            torch.view_as_real(xk * freqs).flatten(3).type_as(k))


@register(dcp_ops.mla_preprocess.default, "mla_preprocess->aten", params=_scatter_params)
def mla_preprocess_aten(x, q_a_weight, q_a_norm_weight, q_b_weight, kv_a_weight, kv_norm_weight, w_uk,
                        rotary, rotary_sin, cache, slot_mapping, q_eps, kv_eps, rotary_kind, *,
                        row_shape: tuple[int, ...]):
    """The unfused preprocess (the reference's ops, in its order) and the scatter write."""
    rank = kv_norm_weight.shape[0]
    rope = kv_a_weight.shape[0] - rank
    batch, tokens = x.shape[:-1]
    q_nope_uk, q_pe, q_c = _query(x, q_a_weight, q_a_norm_weight, q_b_weight, w_uk, q_eps, rope)
    c, k_pe = torch.split(torch.nn.functional.linear(x, kv_a_weight), [rank, rope], dim=-1)
    c = rms_norm(c, kv_norm_weight, kv_eps).view(batch, 1, tokens, rank)
    k_pe = k_pe.view(batch, 1, tokens, rope)
    rotate = _complex_rotary_in_place if rotary_kind == "complex" else ROTARY[rotary_kind]
    q_pe, k_pe = rotate(q_pe, k_pe, rotary, rotary_sin)
    kv = torch.cat([c.view(1, 1, -1, rank), k_pe.view(1, 1, -1, rope)], -1)
    kv_cache_write_as_scatter(cache, kv.select(0, 0).transpose(0, 1), slot_mapping, row_shape=row_shape)
    return torch.cat([q_nope_uk, q_pe], -1), kv, q_c
