"""Decode-step cost model per rank: attention (KV read and FLOPs), DCP collectives, TP
all-reduces and the weight read.

For one decode step of ``batch`` requests, each with ``context`` cached tokens, one query token
each, on a mesh (tp, dcp), per layer and per rank:

* **attention**: the rank reads its shard of every request's KV, ``batch · ⌈context / dcp⌉ ·
  kv_bytes_per_token_per_layer`` bytes (the capacity module's per-token bytes), and does
  ``2 · (Dq + Dv)`` FLOPs per (token, query head) for ``H · dcp`` query heads (DCP all-gathers the
  query heads of its group). DSA models read only ``min(context, index_topk)`` latent tokens plus
  the whole indexer cache. Time ``overhead + max(bytes/bw, flops/rate)`` (or the sum where
  compute does not overlap memory; see :class:`~.hardware.Hardware`), ``overhead`` a fixed cost
  per call and ``bw`` the cache bandwidth when the step's whole working set (every layer's KV
  read plus the weights) fits in half the cache, the memory bandwidth otherwise.
* **DCP collectives** (the ``shard_dcp`` rewrite), with ``T = batch``, ``H`` query heads per rank,
  ``N = dcp``, activations of ``b`` bytes and fp32 partials (the merge accumulates in fp32):
  query all-gather ``(N−1)·T·H·Dq·b`` bytes out of each rank; then ``comm="a2a"``: one all-to-all
  of packed ``[o ‖ lse]``, ``(N−1)·T·H·(Dv+1)·4``; ``comm="ag_rs"``: an LSE all-gather
  ``(N−1)·T·N·H·4`` and a reduce-scatter ``(N−1)·T·H·Dv·4``; ``comm="ag"`` (GQA only: every
  rank computes its group's ``N·H`` query heads, :mod:`dcpgraph.passes.shard_dcp_replicated`):
  no query gather, one all-gather of packed ``[o ‖ lse]`` for all of them,
  ``(N−1)·T·N·H·(Dv+1)·4``. Each collective costs ``latency + bytes / link_bandwidth``.
* **TP all-reduces**: two per layer (after attention and MLP) of ``T·hidden·b``; a ring moves
  ``2·(tp−1)/tp`` of that per rank. ``comm="ag"`` at ``dcp == tp`` holds the output projection
  whole, which removes the attention's all-reduce (one per layer).
* **weights**: every weight byte of the rank is read once per step (``weight_bytes / bw``).

A collective whose group spans several nodes (a TP group larger than a node, or cut across one)
runs at the inter-node link instead (:func:`link_for`): latency ``link_latency + (nodes − 1) ·
inter_node_latency``, bandwidth ``min(link_bandwidth, inter_node_bandwidth)`` (a ring is as fast as
its slowest hop).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .hardware import Hardware
from .model_shape import ModelShape

ACC_BYTES = 4  # fp32 partial outputs and LSEs in the merge


def link_for(hw: Hardware, nodes: int = 1) -> tuple[float, float]:
    """``(latency s, bandwidth bytes/s)`` of a collective over a group spanning ``nodes`` nodes:
    the node's link within one; across them, ``nodes − 1`` inter-node hops of latency and the
    slower of the two bandwidths."""
    if nodes <= 1:
        return hw.link_latency_s, hw.link_bandwidth
    return (hw.link_latency_s + (nodes - 1) * hw.inter_node_latency_s,
            min(hw.link_bandwidth, hw.inter_node_bandwidth))


@dataclass(frozen=True)
class Collective:
    name: str
    bytes_per_rank: int  # sent by each rank, per layer

    def seconds(self, hw: Hardware, nodes: int = 1) -> float:
        """Over a group spanning ``nodes`` nodes: ``latency + bytes / bandwidth`` of :func:`link_for`."""
        latency, bandwidth = link_for(hw, nodes)
        return latency + self.bytes_per_rank / bandwidth


def dcp_collectives(shape: ModelShape, tp: int, dcp: int, comm: str, batch: int,
                    activation_bytes: int = 2) -> list[Collective]:
    """The collectives ``shard_dcp`` adds to one layer (none at dcp=1)."""
    if dcp == 1:
        return []
    n, t, h = dcp, batch, shape.q_heads_per_rank(tp)
    dq, dv = shape.head_dim, shape.v_head_dim
    if comm == "ag":
        return [Collective("all_gather([o‖lse])", (n - 1) * t * n * h * (dv + 1) * ACC_BYTES)]
    out = [Collective("all_gather(q)", (n - 1) * t * h * dq * activation_bytes)]
    if comm == "a2a":
        out.append(Collective("all_to_all([o‖lse])", (n - 1) * t * h * (dv + 1) * ACC_BYTES))
    elif comm == "ag_rs":
        out.append(Collective("all_gather(lse)", (n - 1) * t * n * h * ACC_BYTES))
        out.append(Collective("reduce_scatter(o)", (n - 1) * t * h * dv * ACC_BYTES))
    else:
        raise ValueError(f"comm must be 'a2a', 'ag_rs' or 'ag' at dcp > 1, got {comm!r}")
    return out


def attention_read(shape: ModelShape, tp: int, dcp: int, context: int, batch: int,
                   kv_bytes_per_token_layer: float) -> tuple[float, float]:
    """``(bytes, flops)`` of one layer's context attention on one rank for one decode step."""
    local = math.ceil(context / dcp)
    heads = shape.q_heads_per_rank(tp) * dcp
    if shape.index_topk:
        attended = math.ceil(min(context, shape.index_topk) / dcp)
        index_bytes = shape.index_head_dim + 4  # fp8 key + fp32 scale per token
        latent_bytes = kv_bytes_per_token_layer - index_bytes
        read = batch * (attended * latent_bytes + local * index_bytes)
        flops = batch * (2 * attended * heads * (shape.head_dim + shape.v_head_dim)
                         + 2 * local * shape.index_heads * shape.index_head_dim)
        return read, flops
    read = batch * local * kv_bytes_per_token_layer
    flops = batch * 2 * local * heads * (shape.head_dim + shape.v_head_dim)
    return read, flops


def attention_seconds(read_bytes: float, flops: float, hw: Hardware, working_set_bytes: float | None = None) -> float:
    """One attention call reading ``read_bytes`` with ``flops``; ``working_set_bytes`` (default:
    ``read_bytes``) is everything the step touches, which decides whether it stays in cache."""
    bandwidth = hw.read_bandwidth(read_bytes if working_set_bytes is None else working_set_bytes)
    memory, compute = read_bytes / bandwidth, flops / hw.compute_flops
    core = max(memory, compute) if hw.compute_overlaps_memory else memory + compute
    return hw.attention_overhead_s + core


def tp_allreduces_per_layer(tp: int, dcp: int, comm: str) -> int:
    """TP all-reduces of one layer: after the attention and after the MLP, except that
    ``comm="ag"`` at ``dcp == tp`` holds the output projection whole (no attention all-reduce)."""
    if tp == 1:
        return 0
    return 1 if comm == "ag" and dcp == tp else 2


def tp_allreduce_seconds(shape: ModelShape, tp: int, batch: int, hw: Hardware, activation_bytes: int = 2,
                         count: int = 2, nodes: int = 1) -> float:
    """``count`` TP all-reduces of one layer (zero at tp=1), over a TP group spanning ``nodes``."""
    if tp == 1:
        return 0.0
    wire = 2 * (tp - 1) / tp * batch * shape.hidden_size * activation_bytes
    latency, bandwidth = link_for(hw, nodes)
    return count * (latency + wire / bandwidth)


@dataclass(frozen=True)
class StepCost:
    attention_s: float  # all layers
    collective_s: float  # DCP collectives, all layers
    collective_bytes_per_layer: int
    tp_allreduce_s: float
    weights_s: float

    @property
    def step_s(self) -> float:
        return self.attention_s + self.collective_s + self.tp_allreduce_s + self.weights_s


def decode_step(shape: ModelShape, hw: Hardware, *, tp: int, dcp: int, comm: str, context: int, batch: int,
                kv_bytes_per_token_layer: float, weight_bytes: int, tp_nodes: int = 1,
                dcp_nodes: int = 1, layer_read: tuple[float, float] | None = None) -> StepCost:
    """Predicted decode step of ``batch`` requests at ``context`` tokens (the sum of the parts:
    nothing is assumed to overlap across parts); ``tp_nodes``/``dcp_nodes``: the nodes a TP group
    and a DCP group span (their collectives cross nodes when more than one). ``layer_read``:
    one layer's ``(bytes, flops)`` when the caller models the attention's reads itself
    (DeepSeek-V4's compressed caches, :func:`~.compressed_capacity.attention_read`)."""
    layers = shape.num_layers
    read, flops = layer_read or attention_read(shape, tp, dcp, context, batch, kv_bytes_per_token_layer)
    colls = dcp_collectives(shape, tp, dcp, comm, batch, shape.dtype_bytes)
    return StepCost(
        attention_s=layers * attention_seconds(read, flops, hw, layers * read + weight_bytes),
        collective_s=layers * sum(c.seconds(hw, dcp_nodes) for c in colls),
        collective_bytes_per_layer=sum(c.bytes_per_rank for c in colls),
        tp_allreduce_s=layers * tp_allreduce_seconds(shape, tp, batch, hw, shape.dtype_bytes,
                                                     tp_allreduces_per_layer(tp, dcp, comm), tp_nodes),
        weights_s=weight_bytes / hw.memory_bandwidth,
    )
