"""Head-sharded attention whatever the model's own TP plan says, as vLLM shards attention.

An attention module is recognised by its projections, not by its plan: ``nn.Linear`` children
``q_proj``/``k_proj``/``v_proj`` (or one fused ``qkv_proj`` laid out ``[q; k; v]``, or a per-head
interleaved ``query_key_value`` of a multi-head model) and an output projection ``o_proj`` /
``out_proj`` / ``dense``. Its entries are then

- q, k, v column-parallel (``colwise``; the fused ``qkv_proj`` ``qkv_colwise``: each of its q, k
  and v sections split by head), biases with their weight;
- the output projection row-parallel (``rowwise``: all-reduce, bias added once);
- a 1-D norm over one head (``head_dim`` entries) replicated; a 1-D norm over a projection's whole
  width (OLMo-2's ``q_norm`` over ``num_heads·head_dim``, BitNet's ``attn_sub_norm`` over the
  attention output) ``norm_colwise``: its weight split with the width it normalises and its mean
  of squares averaged over the TP group;
- a per-head ``sinks`` parameter split with the query heads, and an output gate (a linear as wide
  as the queries, AFMoE's ``gate_proj``) column-parallel with them.

A module with any other parameter keeps the model's plan (whatever it says is checked by
``shard_tp``, which refuses K/V that are not head-sharded).
"""

from __future__ import annotations

import re

import torch

QKV_NAMES = ("q_proj", "k_proj", "v_proj")
OUTPUT_NAMES = ("o_proj", "out_proj", "dense")
OUTPUT_GATE_NAMES = ("gate_proj",)


def head_sharded_attention(model: torch.nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """``plan`` with every recognised attention module's entries replaced by head-sharded ones
    (those come first, so they win :func:`~dcpgraph.passes.tp_styles.plan_rule`'s first match)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = getattr(config, "num_attention_heads", None)
    if not heads or getattr(config, "kv_lora_rank", None) is not None:
        return plan
    kv_heads = _global(config, "num_key_value_heads") or heads
    head_dim = _global(config, "head_dim") or config.hidden_size // heads
    by_pattern: dict[str, dict[str, str] | None] = {}
    for name, module in model.named_modules():
        entries = _module_entries(module, heads, kv_heads, head_dim)
        if entries is _NOT_ATTENTION:
            continue
        pattern = re.sub(r"(^|\.)(\d+)(?=\.|$)", r"\1*", name)
        if pattern in by_pattern and by_pattern[pattern] != entries:
            entries = None  # layers under one pattern that differ: keep the model's plan
        by_pattern[pattern] = entries
    added = {f"{pattern}.{child}": style for pattern, entries in by_pattern.items() if entries
             for child, style in entries.items()}
    if not added:
        return plan
    return {**added, **{k: v for k, v in plan.items() if k not in added}}


_NOT_ATTENTION: dict[str, str] = {}


def _global(config, name: str):
    """``config.name``, or None when absent or declared per layer (a heterogeneous config, whose
    modules then say their own value)."""
    try:
        return getattr(config, name, None)
    except RuntimeError:  # transformers' AmbiguousGlobalPerLayerAttributeError
        return None


def _keys_are_values(module: torch.nn.Module) -> bool:
    """q and k projections and a ``v_proj`` that is declared but None: the values are computed
    from ``k_proj``'s output."""
    return (_linear(module, "q_proj") is not None and _linear(module, "k_proj") is not None
            and hasattr(module, "v_proj") and module.v_proj is None)


def _module_shape(module: torch.nn.Module, heads: int, kv_heads: int, head_dim: int) -> tuple[int, int, int]:
    """``(kv_heads, head_dim, v_head_dim)`` of one attention module: its own ``head_dim`` /
    ``v_head_dim`` attributes where it has them (layers whose shapes differ: Gemma-4's global
    layers, MiMo-V2-Flash's values), its KV heads from its ``k_proj`` width; else the config's."""
    head_dim = int(getattr(module, "head_dim", None) or head_dim)
    v_head_dim = int(getattr(module, "v_head_dim", None) or head_dim)
    k = _linear(module, "k_proj")
    if k is not None and k.out_features % head_dim == 0 and heads % max(k.out_features // head_dim, 1) == 0:
        kv_heads = max(k.out_features // head_dim, 1)
    return kv_heads, head_dim, v_head_dim


def _linear(module: torch.nn.Module, name: str) -> torch.nn.Linear | None:
    child = getattr(module, name, None)
    return child if isinstance(child, torch.nn.Linear) else None


def _module_entries(module: torch.nn.Module, heads: int, kv_heads: int, head_dim: int):
    """The child → style entries of one attention module; :data:`_NOT_ATTENTION` when ``module``
    has no q/k/v and output projections, None when it has parameters this planning does not know
    (the model's plan then stays)."""
    output = next((n for n in OUTPUT_NAMES if _linear(module, n) is not None), None)
    if output is None:
        return _NOT_ATTENTION
    kv_heads, head_dim, v_head_dim = _module_shape(module, heads, kv_heads, head_dim)
    q_width, kv_width = heads * head_dim, kv_heads * head_dim
    if all(_linear(module, n) is not None for n in QKV_NAMES):
        entries = {n: "colwise" for n in QKV_NAMES}
        widths = {n: _linear(module, n).out_features for n in QKV_NAMES}
        if widths != {"q_proj": q_width, "k_proj": kv_width, "v_proj": kv_heads * v_head_dim}:
            return None
    elif _keys_are_values(module):  # Gemma-4's attention_k_eq_v layers: values from k_proj
        entries = {"q_proj": "colwise", "k_proj": "colwise"}
        if (_linear(module, "q_proj").out_features, _linear(module, "k_proj").out_features) != (q_width, kv_width):
            return None
    elif (fused := _linear(module, "qkv_proj")) is not None:
        if fused.out_features != q_width + 2 * kv_width:
            return None
        entries = {"qkv_proj": "qkv_colwise"}
    elif (fused := _linear(module, "query_key_value")) is not None:
        # [heads, 3, head_dim] rows: a split by whole heads keeps each head's q, k and v together.
        if kv_heads != heads or fused.out_features != 3 * q_width:
            return None
        entries = {"query_key_value": "colwise"}
    else:
        return _NOT_ATTENTION
    entries[output] = "rowwise"
    for child_name, child in module.named_children():
        if child_name in entries:
            continue
        style = _other_child_style(child_name, child, q_width, kv_width, head_dim)
        if style is None:
            return None
        if style:
            entries[child_name] = style
    for param_name, param in module.named_parameters(recurse=False):
        if param_name == "sinks" and param.dim() == 1 and param.numel() == heads:
            entries["sinks"] = "colwise"  # one logit per query head
        else:
            return None
    return entries


def _other_child_style(name: str, child: torch.nn.Module, q_width: int, kv_width: int, head_dim: int):
    """The style of a child besides the projections: ``""`` for one that holds no parameters or
    a per-head norm (replicated), None for one not recognised."""
    params = dict(child.named_parameters())
    if not params:
        return ""  # rotary embedding, dropout, activation
    if name in OUTPUT_GATE_NAMES and isinstance(child, torch.nn.Linear) and child.out_features == q_width:
        return "colwise"
    if isinstance(child, torch.nn.Linear) or any(p.dim() != 1 for p in params.values()):
        return None
    sizes = {p.numel() for p in params.values()}
    if sizes == {head_dim}:
        return ""
    if len(sizes) == 1 and sizes <= {q_width, kv_width} and set(params) == {"weight"}:
        return "norm_colwise"
    return None
