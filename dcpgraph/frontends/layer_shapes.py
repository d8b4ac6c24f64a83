"""Per-layer attention shapes: the KV head count and query/key head dim of every attention layer.

Most models have one of each for the whole model (``ModelFacts.num_kv_heads`` / ``head_dim``).
Some do not: Gemma-4's global layers have their own head dim (and, with ``attention_k_eq_v``,
their own KV head count) beside its sliding layers, MiMo-V2-Flash's sliding layers twice the
full layers' KV heads. Two sources give the per-layer values:

* a heterogeneous config (transformers' ``per_layer_config``, what Gemma-4 declares), read before
  anything is traced, so the mesh is checked per layer before tracing;
* the canonical graph: the ``[1, H, T, D]`` keys each ``dcpgraph.attention`` node reads, which
  also sees counts the modeling code derives itself (MiMo's doubled sliding heads).

``ModelFacts.layer_kv_heads`` / ``layer_head_dims`` hold them (graph order), only where layers
differ: a uniform model keeps both empty, and every uniform code path is unchanged.
"""

from __future__ import annotations

import dataclasses

import torch

from ..program import ModelFacts, Program

dcp_ops = torch.ops.dcpgraph


def config_per_layer(config, name: str) -> tuple | None:
    """The per-layer values of ``name`` in a heterogeneous config (one per decoder layer), or None
    when the config declares one value for the whole model."""
    per_layer = getattr(config, "per_layer_attributes", None) or set()
    if name not in per_layer:
        return None
    layers = config.per_layer_config
    return tuple(getattr(layers[i], name) for i in range(len(layers)))


def differing(values) -> tuple[int, ...]:
    """``values`` as ints when they are not all equal, else ``()`` (the uniform case)."""
    values = tuple(int(v) for v in values or ())
    return values if len(set(values)) > 1 else ()


def graph_layer_shapes(program: Program) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(kv_heads, head_dims)`` of each GQA attention node of the canonical graph, in graph order."""
    nodes = [n for n in program.graph_module.graph.nodes
             if n.op == "call_function" and n.target is dcp_ops.attention.default]
    keys = [n.args[1].meta.get("val") for n in nodes]
    if not keys or any(k is None for k in keys):
        return (), ()
    return tuple(int(k.shape[1]) for k in keys), tuple(int(k.shape[-1]) for k in keys)


def with_graph_layer_shapes(facts: ModelFacts, program: Program) -> ModelFacts:
    """``facts`` with per-layer KV heads and head dims taken from ``program``'s canonical graph
    (GQA only: MLA's latent cache has one head of one width in every layer)."""
    if facts.attention != "gqa":
        return facts
    kv_heads, head_dims = graph_layer_shapes(program)
    kv_heads, head_dims = differing(kv_heads), differing(head_dims)
    if (kv_heads, head_dims) == (facts.layer_kv_heads, facts.layer_head_dims):
        return facts
    return dataclasses.replace(facts, layer_kv_heads=kv_heads, layer_head_dims=head_dims)
