"""The MLA preprocess as one op: its math, written as the unfused code it replaces.

``mla_preprocess`` (``torch.ops.dcpgraph.mla_preprocess``, registered in :mod:`.library`) computes,
for the hidden states ``x [1, T, D]`` of one layer after its input norm (``R`` = kv_lora_rank,
``nope``/``rope`` the query-key head dims, ``H`` the local query heads)::

    q_c   = rms_norm(x·W_DQᵀ, γ_q, ε_q)                   (absent without q_lora_rank: q = x·W_Qᵀ)
    q     = (q_c·W_UQᵀ).view(1, T, H, nope + rope)ᵀ  →  q_nope [1,H,T,nope], q_pe [1,H,T,rope]
    c, k_pe = split(x·W_DKVᵀ, [R, rope]);  c = rms_norm(c, γ_kv, ε_kv)
    q_pe, k_pe = rotary(q_pe, k_pe)
    kv    = [c ‖ k_pe]                        [1, 1, T, R + rope]   (the latent cache row)
    q_lat = [q_nope·W_UK ‖ q_pe]              [1, H, T, R + rope]   (absorbed query)
    cache[slot_mapping[t]] = kv[t]            (slot −1 skipped: a DCP rank that does not own t)

and returns ``(q_lat, kv, q_c)`` (``q_c`` is ``[0]`` without ``q_lora_rank``). ``W_UK`` is
``absorb_mla``'s ``[H, nope, R]``. The rotary comes in the three forms HF's DeepSeek models trace
to (:data:`ROTARY_KINDS`): ``"interleave"`` (``rope_interleave=True``: even/odd pairs rotated,
output halves), ``"rotate_half"`` and ``"complex"`` (DeepSeek-V2's ``freqs_cis``: ``rotary`` is the
complex rotation ``[1, T, rope/2]`` and ``rotary_sin`` is None).

:func:`mla_preprocess_math` is both the reference kernel and the pattern ``fuse_mla_preprocess``
matches: it is traced with ``make_fx`` into the aten ops ``torch.export`` produces for HF's code,
so the fused reference kernel runs the same aten ops in the same order on the same values, and is
bit-identical to the unfused graph. RMSNorm computes in fp32 and casts back (HF's
``DeepseekV3RMSNorm``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .paged import write_slots

ROTARY_KINDS = ("interleave", "rotate_half", "complex")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight · (x / sqrt(mean(x², -1) + eps))``, the mean in fp32, the product in x's dtype."""
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def rotary_interleave(q, k, cos, sin):
    """Pairs ``(x[2i], x[2i+1])`` rotated by angle ``i``; output ``[even' ‖ odd']``.
    ``cos``/``sin`` ``[1, T, rope]`` hold ``cat(freqs, freqs)``."""
    cos = cos[..., : cos.shape[-1] // 2].unsqueeze(1)
    sin = sin[..., : sin.shape[-1] // 2].unsqueeze(1)
    q1, q2 = q[..., 0::2], q[..., 1::2]
    k1, k2 = k[..., 0::2], k[..., 1::2]
    q_embed = torch.cat([q1 * cos - q2 * sin, q2 * cos + q1 * sin], dim=-1)
    k_embed = torch.cat([k1 * cos - k2 * sin, k2 * cos + k1 * sin], dim=-1)
    return q_embed, k_embed


def rotary_rotate_half(q, k, cos, sin):
    """``x·cos + rotate_half(x)·sin`` with ``cos``/``sin`` ``[1, T, rope]``."""
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    return (q * cos) + (_rotate_half(q) * sin), (k * cos) + (_rotate_half(k) * sin)


def rotary_complex(q, k, freqs, _unused=None):
    """Pairs as complex numbers times ``freqs [1, T, rope/2]`` (complex64), in fp32."""
    xq = torch.view_as_complex(q.float().reshape(*q.shape[:-1], -1, 2))
    xk = torch.view_as_complex(k.float().reshape(*k.shape[:-1], -1, 2))
    freqs = freqs.unsqueeze(1).to(xq.device)
    q_out = torch.view_as_real(xq * freqs).flatten(3).type_as(q)
    k_out = torch.view_as_real(xk * freqs).flatten(3).type_as(k)
    return q_out, k_out


ROTARY = {"interleave": rotary_interleave, "rotate_half": rotary_rotate_half, "complex": rotary_complex}


def mla_preprocess_math(
    x, q_a_weight, q_a_norm_weight, q_b_weight, kv_a_weight, kv_norm_weight, w_uk, rotary, rotary_sin,
    q_eps: float, kv_eps: float, rotary_kind: str,
):
    """``(q_lat, kv, q_c)`` of the module docstring, without the cache write (``q_c`` None when
    ``q_a_weight`` is None, and ``q_b_weight`` is then ``q_proj``'s weight)."""
    if rotary_kind not in ROTARY:
        raise ValueError(f"rotary_kind must be one of {list(ROTARY_KINDS)}, got {rotary_kind!r}")
    rank = kv_norm_weight.shape[0]
    rope = kv_a_weight.shape[0] - rank
    nope = w_uk.shape[1]
    batch, tokens = x.shape[:-1]
    if q_a_weight is None:
        q_c = None
        q = F.linear(x, q_b_weight)
    else:
        q_c = rms_norm(F.linear(x, q_a_weight), q_a_norm_weight, q_eps)
        q = F.linear(q_c, q_b_weight)
    q = q.view(batch, tokens, -1, nope + rope).transpose(1, 2)
    q_nope, q_pe = torch.split(q, [nope, rope], dim=-1)
    compressed = F.linear(x, kv_a_weight)
    c, k_pe = torch.split(compressed, [rank, rope], dim=-1)
    c = rms_norm(c, kv_norm_weight, kv_eps).view(batch, 1, tokens, rank)
    k_pe = k_pe.view(batch, 1, tokens, rope)
    q_pe, k_pe = ROTARY[rotary_kind](q_pe, k_pe, rotary, rotary_sin)
    # absorb_mla's latent key and absorbed query
    kv = torch.cat([c.view(1, 1, -1, rank), k_pe.view(1, 1, -1, rope)], -1)
    q_lat = torch.cat([torch.matmul(q_nope, w_uk), q_pe], -1)
    return q_lat, kv, q_c


def mla_preprocess_reference(x, q_a_weight, q_a_norm_weight, q_b_weight, kv_a_weight, kv_norm_weight, w_uk,
                             rotary, rotary_sin, cache, slot_mapping, q_eps, kv_eps, rotary_kind):
    """The op's CPU kernel: :func:`mla_preprocess_math`, then the latent cache write."""
    q_lat, kv, q_c = mla_preprocess_math(x, q_a_weight, q_a_norm_weight, q_b_weight, kv_a_weight, kv_norm_weight,
                                         w_uk, rotary, rotary_sin, q_eps, kv_eps, rotary_kind)
    write_slots(cache, kv.select(0, 0).transpose(0, 1), slot_mapping)
    q_c = x.new_empty((0,)) if q_c is None else q_c
    return q_lat.contiguous(), kv.contiguous(), q_c.contiguous()


def mla_preprocess_fake(x, q_a_weight, q_a_norm_weight, q_b_weight, kv_a_weight, kv_norm_weight, w_uk,
                        rotary, rotary_sin, cache, slot_mapping, q_eps, kv_eps, rotary_kind):
    rank = kv_norm_weight.shape[0]
    rope = kv_a_weight.shape[0] - rank
    heads = w_uk.shape[0]
    batch, tokens = x.shape[:-1]
    q_lat = x.new_empty((batch, heads, tokens, rank + rope))
    kv = x.new_empty((1, 1, tokens, rank + rope))
    q_c = x.new_empty((0,)) if q_a_weight is None else x.new_empty((batch, tokens, q_a_weight.shape[0]))
    return q_lat, kv, q_c
