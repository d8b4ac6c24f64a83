"""Time to first token of one prompt with prefill context parallelism: a roofline estimate.

One prefill of ``n`` new tokens, no cached prefix, on a mesh (tp, pcp); for the busiest PCP rank
(the zigzag split of :mod:`dcpgraph.pcp.split` gives it ``⌈n / 2pcp⌉`` tokens from each of its
two chunks, at most):

* **dense**: ``2 · P_active`` FLOPs per token, ``P_active`` the rank's weights less the routed
  experts a token does not use (``experts_per_token / n_routed_experts`` of them); the embedding
  and LM head are counted as weights, so small models are overestimated by their share;
* **attention**: ``(Dq + Dv) · 2 · H_r`` FLOPs per (query, visible key), ``H_r`` the rank's query
  heads, over the rank's causal keys ``Σ_i (i + 1)`` (:func:`dcpgraph.pcp.split.causal_work`);
* **K/V exchange** (pcp > 1): one all-gather per layer, each rank receiving ``(pcp − 1)/pcp · n``
  tokens' K/V of its KV heads, ``latency + bytes / link_bandwidth`` per layer;
* **TP all-reduces** (tp > 1): two per layer of ``tokens · hidden · b``, a ring moving
  ``2 (tp − 1)/tp`` of that per rank.

``ttft = dense / linear_rate + attention / attention_rate + exchange + all-reduces`` with the two
rates :meth:`Hardware.prefill_flops` gives for the model's element width ``b`` (measured on
``this-machine``: a bf16 linear on a CPU without bf16 arithmetic runs several times slower than an
fp32 one, its flash attention does not; the datasheet's dense bf16 figure for both on a preset).
No overlap of transfers with compute is assumed (the all-gather precedes the attention that needs
it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..pcp.split import causal_work
from .hardware import Hardware
from .model_shape import ModelShape


@dataclass(frozen=True)
class PrefillEstimate:
    """Per-rank work and time of one prefill (the busiest PCP rank)."""

    tokens_per_rank: int
    dense_flops: float
    attention_flops: float
    exchange_bytes: float
    compute_s: float
    exchange_s: float
    allreduce_s: float

    @property
    def ttft_s(self) -> float:
        return self.compute_s + self.exchange_s + self.allreduce_s


def causal_keys_busiest_rank(n: int, pcp: int) -> int:
    """``max_r Σ_{i in rank r's tokens} (i + 1)`` under the zigzag split."""
    return max(causal_work(n, pcp, r) for r in range(pcp))


def kv_bytes_per_token_per_layer(shape: ModelShape, tp: int) -> int:
    """The new K/V one rank exchanges per token and layer: its KV heads' K and V (MLA: the latent)."""
    if shape.attention == "mla":
        return shape.head_dim * shape.dtype_bytes
    return shape.kv_heads_per_rank(tp) * (shape.head_dim + shape.v_head_dim) * shape.dtype_bytes


def active_params_per_rank(shape: ModelShape, tp: int) -> float:
    total = shape.weight_params_per_rank(tp)
    if not shape.moe_layers or not shape.n_routed_experts:
        return float(total)
    routed = shape.routed_expert_params_per_rank(tp)
    return total - routed + routed * shape.experts_per_token / shape.n_routed_experts


def prefill_estimate(shape: ModelShape, hw: Hardware, *, tp: int, pcp: int, prompt_tokens: int) -> PrefillEstimate:
    """The estimate the module docstring states."""
    n, layers, b = prompt_tokens, shape.num_layers, shape.dtype_bytes
    tokens = min(n, 2 * math.ceil(n / (2 * pcp)))
    dense = 2.0 * active_params_per_rank(shape, tp) * tokens
    attention = (2.0 * shape.q_heads_per_rank(tp) * (shape.head_dim + shape.v_head_dim)
                 * causal_keys_busiest_rank(n, pcp) * layers)
    exchange_bytes = (pcp - 1) / pcp * n * kv_bytes_per_token_per_layer(shape, tp) * layers
    exchange_s = layers * hw.link_latency_s + exchange_bytes / hw.link_bandwidth if pcp > 1 else 0.0
    allreduce = 2 * layers * (hw.link_latency_s + 2 * (tp - 1) / tp * tokens * shape.hidden_size * b
                              / hw.link_bandwidth) if tp > 1 else 0.0
    linear_rate, attention_rate = hw.prefill_flops(b)
    return PrefillEstimate(tokens, dense, attention, exchange_bytes, dense / linear_rate + attention / attention_rate,
                           exchange_s, allreduce)
