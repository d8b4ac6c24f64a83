"""Gated delta net layers of HF models as canonical weights, and their TP split by head groups.

Three HF layouts are recognised structurally (by their parameters, not their class names):

- ``qwen3_next`` (``Qwen3NextGatedDeltaNet``): fused ``in_proj_qkvz [Hk·(2Dk + 2rDv), H]`` laid
  out per key head ``[q_h | k_h | v_h (r heads) | z_h (r heads)]`` and ``in_proj_ba [Hk·2r, H]``
  per key head ``[b_h (r) | a_h (r)]``, ``r = Hv/Hk``;
- ``qwen3_5`` (``Qwen3_5GatedDeltaNet``): ``in_proj_qkv [2·Hk·Dk + Hv·Dv, H]`` as
  ``[q | k | v]``, and separate ``in_proj_z``, ``in_proj_b``, ``in_proj_a``;
- ``olmo_hybrid`` (``OlmoHybridGatedDeltaNet``): separate ``q_proj``, ``k_proj``, ``v_proj``, the
  gate ``g_proj`` (qwen's ``z``), ``b_proj``, ``a_proj``, the output ``o_proj`` and its gated norm
  ``o_norm``; with ``allow_neg_eigval`` it doubles ``β`` (range ``[0, 2]``).

Both become :class:`~dcpgraph.ops.gated_delta_layer.GatedDeltaNetWeights`, whose value heads are
numbered ``h = key_head·r + j`` in both layouts, so the split is the same: rank ``i`` of ``tp``
takes key heads ``[i·Hk/tp, (i+1)·Hk/tp)`` and their value heads, i.e. a contiguous ``1/tp`` of
every projection's rows, of each of the conv's ``q``, ``k`` and ``v`` channel segments, of
``a_log``/``dt_bias``, and of ``out_proj``'s columns; the per-head norm weight is replicated.
Where ``tp`` does not divide ``Hk`` every rank holds the whole layer (its output is complete on
each rank: no all-reduce), as :meth:`~dcpgraph.recurrent_state.GatedDeltaNetShape.on_rank` counts.
"""

from __future__ import annotations

import dataclasses

import torch

from ..errors import UnsupportedModelError
from ..ops.gated_delta_layer import GatedDeltaNetWeights
from ..recurrent_state import GatedDeltaNetShape

FUSED_PROJECTIONS = ("in_proj_qkvz", "in_proj_ba")
SPLIT_PROJECTIONS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
COMMON = ("conv1d", "A_log", "dt_bias", "norm", "out_proj")
OLMO_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "g_proj", "b_proj", "a_proj")
OLMO_COMMON = ("conv1d", "A_log", "dt_bias", "o_norm", "o_proj")
SUPPORTED_ACTIVATIONS = ("silu",)


def is_gated_delta_net(module: torch.nn.Module) -> bool:
    """Whether ``module`` has a recognised GDN layout's parameters."""
    def has(names) -> bool:
        return all(hasattr(module, n) for n in names)

    return (has(COMMON) and (has(FUSED_PROJECTIONS) or has(SPLIT_PROJECTIONS))
            or has(OLMO_COMMON) and has(OLMO_PROJECTIONS))


def shape_of(module: torch.nn.Module) -> GatedDeltaNetShape:
    return GatedDeltaNetShape(int(module.num_k_heads), int(module.num_v_heads), int(module.head_k_dim),
                              int(module.head_v_dim), int(module.conv_kernel_size))


def canonical_weights(module: torch.nn.Module) -> GatedDeltaNetWeights:
    """The full (unsharded) canonical weights of an HF GDN module; refuses by name a layout or
    activation it does not know. Per-key-head layouts are viewed with ``-1`` heads, so a traced
    layer's only head-dependent sizes are the ``[q | k | v]`` section splits."""
    where = f"layer {getattr(module, 'layer_idx', '?')} ({type(module).__name__})"
    if not is_gated_delta_net(module):
        raise UnsupportedModelError(
            f"{where}: not a recognised gated delta net layout (needs {list(COMMON)} and either "
            f"{list(FUSED_PROJECTIONS)} or {list(SPLIT_PROJECTIONS)}, or {list(OLMO_COMMON + OLMO_PROJECTIONS)})")
    if getattr(module, "activation", None) not in SUPPORTED_ACTIVATIONS:
        raise UnsupportedModelError(f"{where}: conv activation {getattr(module, 'activation', None)!r} is not "
                                    f"supported; supported: {list(SUPPORTED_ACTIVATIONS)}")
    s = shape_of(module)
    hk, hv, dk, dv, hidden = s.key_heads, s.value_heads, s.key_dim, s.value_dim, module.hidden_size
    r = hv // hk
    if hasattr(module, "in_proj_qkvz"):
        qkvz = module.in_proj_qkvz.weight.view(-1, 2 * dk + 2 * r * dv, hidden)
        q, k, v, z = qkvz.split([dk, dk, r * dv, r * dv], dim=1)
        b, a = module.in_proj_ba.weight.view(-1, 2 * r, hidden).split([r, r], dim=1)
        w_q, w_k, w_v, w_z = (t.reshape(-1, hidden) for t in (q, k, v, z))
        w_b, w_a = b.reshape(-1, hidden), a.reshape(-1, hidden)
        projections = (module.in_proj_qkvz, module.in_proj_ba)
    elif hasattr(module, "in_proj_qkv"):
        w_q, w_k, w_v = module.in_proj_qkv.weight.split([hk * dk, hk * dk, hv * dv], dim=0)
        w_z, w_b, w_a = module.in_proj_z.weight, module.in_proj_b.weight, module.in_proj_a.weight
        projections = (module.in_proj_qkv, module.in_proj_z, module.in_proj_b, module.in_proj_a)
    else:
        projections = tuple(getattr(module, name) for name in OLMO_PROJECTIONS)
        w_q, w_k, w_v, w_z, w_b, w_a = (p.weight for p in projections)
    if any(getattr(p, "bias", None) is not None for p in projections):
        raise UnsupportedModelError(f"{where}: projection biases are not supported")
    conv = module.conv1d
    norm = module.norm if hasattr(module, "norm") else module.o_norm
    out_proj = module.out_proj if hasattr(module, "out_proj") else module.o_proj
    return GatedDeltaNetWeights(
        key_heads=hk, value_heads=hv, key_dim=dk, value_dim=dv,
        w_q=w_q.contiguous(), w_k=w_k.contiguous(), w_v=w_v.contiguous(), w_z=w_z.contiguous(),
        w_b=w_b.contiguous(), w_a=w_a.contiguous(),
        conv_weight=conv.weight.squeeze(1), conv_bias=conv.bias,
        a_log=module.A_log, dt_bias=module.dt_bias,
        norm_weight=norm.weight, norm_eps=float(norm.variance_epsilon), out_proj=out_proj.weight,
        beta_scale=2.0 if getattr(module, "allow_neg_eigval", False) else 1.0,
    )


def tp_shard(full: GatedDeltaNetWeights, rank: int, tp: int) -> GatedDeltaNetWeights:
    """Rank ``rank``'s share of ``full`` in a TP group of ``tp`` (see the module docstring);
    the whole layer where ``tp`` does not divide the key heads."""
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} is outside a TP group of {tp}")
    if full.key_heads % tp:
        return full

    def part(t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        return t.chunk(tp, dim)[rank].contiguous()

    qk = full.key_heads * full.key_dim
    conv_q, conv_k, conv_v = full.conv_weight.split([qk, qk, full.value_heads * full.value_dim], dim=0)
    conv_bias = None
    if full.conv_bias is not None:
        bias_q, bias_k, bias_v = full.conv_bias.split([qk, qk, full.value_heads * full.value_dim])
        conv_bias = torch.cat([part(bias_q), part(bias_k), part(bias_v)])
    return dataclasses.replace(
        full, key_heads=full.key_heads // tp, value_heads=full.value_heads // tp,
        w_q=part(full.w_q), w_k=part(full.w_k), w_v=part(full.w_v), w_z=part(full.w_z),
        w_b=part(full.w_b), w_a=part(full.w_a),
        conv_weight=torch.cat([part(conv_q), part(conv_k), part(conv_v)]), conv_bias=conv_bias,
        a_log=part(full.a_log), dt_bias=part(full.dt_bias), out_proj=part(full.out_proj, 1),
    )
