"""One TP rank's slice of a transformers Llama/Qwen3 decoder layer, for the eager PCP path.

TP rank ``t`` of ``tp`` holds query heads ``[t·Hq/tp, (t+1)·Hq/tp)``; KV heads
``[t·Hkv/tp, (t+1)·Hkv/tp)`` when ``Hkv >= tp``, else the one head ``t·Hkv // tp`` (replicated
on ``tp / Hkv`` consecutive ranks, the rule of :func:`dcpgraph.mesh.local_kv_heads`); the matching
rows of ``q/k/v_proj`` and columns of ``o_proj``; MLP columns ``[t·I/tp, (t+1)·I/tp)`` of gate/up
and the same rows of down. ``o_proj`` and the MLP then give partial sums, reduced over the TP group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import ConfigError


@dataclass(frozen=True)
class LayerShard:
    """Weights ``[out, in]`` (and biases, None where the layer has none) of one layer on one TP rank."""

    wq: torch.Tensor
    bq: torch.Tensor | None
    wk: torch.Tensor
    bk: torch.Tensor | None
    wv: torch.Tensor
    bv: torch.Tensor | None
    wo: torch.Tensor
    bo: torch.Tensor | None
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor


def _rows(linear: torch.nn.Linear, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    bias = None if linear.bias is None else linear.bias[start:end]
    return linear.weight[start:end], bias


def layer_shard(layer: torch.nn.Module, tp: int, tp_rank: int, num_q_heads: int, num_kv_heads: int) -> LayerShard:
    """``layer``'s slice on TP rank ``tp_rank`` (views of its weights; the whole layer at tp = 1)."""
    attn, mlp = layer.self_attn, layer.mlp
    d, inter = attn.head_dim, mlp.gate_proj.out_features
    if inter % tp or num_q_heads % tp:
        raise ConfigError(f"tp={tp} must divide the MLP width ({inter}) and the query heads ({num_q_heads})")
    if getattr(mlp.gate_proj, "bias", None) is not None or getattr(mlp.down_proj, "bias", None) is not None:
        raise ConfigError("the eager PCP path's TP slices take MLPs without biases")
    hq = num_q_heads // tp
    if num_kv_heads >= tp:
        hkv = num_kv_heads // tp
        k0 = tp_rank * hkv
    else:
        hkv, k0 = 1, tp_rank * num_kv_heads // tp
    wq, bq = _rows(attn.q_proj, tp_rank * hq * d, (tp_rank + 1) * hq * d)
    wk, bk = _rows(attn.k_proj, k0 * d, (k0 + hkv) * d)
    wv, bv = _rows(attn.v_proj, k0 * d, (k0 + hkv) * d)
    wo = attn.o_proj.weight[:, tp_rank * hq * d:(tp_rank + 1) * hq * d]
    i0, i1 = tp_rank * inter // tp, (tp_rank + 1) * inter // tp
    return LayerShard(wq, bq, wk, bk, wv, bv, wo, attn.o_proj.bias, mlp.gate_proj.weight[i0:i1],
                      mlp.up_proj.weight[i0:i1], mlp.down_proj.weight[:, i0:i1])


def model_shards(model: torch.nn.Module, tp: int, tp_rank: int) -> list[LayerShard]:
    """Every decoder layer's slice on TP rank ``tp_rank``."""
    config = model.config
    return [layer_shard(layer, tp, tp_rank, config.num_attention_heads, config.num_key_value_heads)
            for layer in model.model.layers]
