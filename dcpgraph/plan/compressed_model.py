"""DeepSeek-V4's planner shape: the fields of its HF config the byte formula and the weight count
read, and the parameters one rank holds.

Every V4 layer is shared-KV MQA over one ``D = head_dim`` head with a low-rank query
(``q_a_proj`` ``hid → q_lora_rank``, ``q_b_proj`` to ``H·D``), a per-head sink, a grouped
low-rank output projection (``o_a_proj``: each of ``o_groups`` groups maps its ``H·D / g``
channels to ``o_lora_rank``; ``o_b_proj``: ``g·o_lora_rank → hid``), and a compressor on
compressed layers (HCA: values and gates of width ``D`` and a ``[m, D]`` position bias; CSA: twice
that width, plus the lightning indexer's own compressor at ``Di = index_head_dim``, its query
projection ``q_lora_rank → index_n_heads·Di`` and head weights ``hid → index_n_heads``). Every
layer is MoE (a hash or a learned router over ``n_routed_experts``, shared experts) with two
hyper-connection mixers (``(2 + hc)·hc`` rows over ``hc·hid``, a bias and 3 scales each), and the
head a final hyper-connection mixer (``hc`` rows, a bias, 1 scale).

Sharding assumed per rank at tensor parallel ``tp`` (the layout ``docs/compressed-attention.md``
describes for the compiled layer): query heads, sinks and the grouped output projection split by
``tp`` (``o_groups % tp == 0``); the query down projection, the single KV head, the compressors
and the indexer replicated (like MLA's latent path); routed experts ``sharded`` or ``replicated``,
shared experts and the vocabulary split by ``tp``.
"""

from __future__ import annotations

import math

from ..errors import ConfigError

CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"


def compressed_fields(c: dict) -> dict:
    """The V4-only fields of :class:`~.model_shape.ModelShape` from an HF ``deepseek_v4`` config
    dict (HF's defaults where the dict omits a key, as ``DeepseekV4Config`` fills them)."""
    layers = int(c["num_hidden_layers"])
    layer_types = c.get("layer_types") or default_layer_types(layers)
    if len(layer_types) != layers:
        raise ConfigError(f"deepseek_v4: {len(layer_types)} layer_types for {layers} layers")
    rates = dict(c.get("compress_rates") or {CSA: 4, HCA: 128})
    return dict(
        sliding_window=int(c.get("sliding_window") or 128), layer_types=tuple(layer_types),
        compress_rates=tuple(sorted((k, int(v)) for k, v in rates.items())),
        o_groups=int(c.get("o_groups") or 8), o_lora_rank=int(c.get("o_lora_rank") or 1024),
        hc_mult=int(c.get("hc_mult") or 4),
    )


def default_layer_types(layers: int) -> list[str]:
    """HF's schedule when a config gives none: two HCA layers, then CSA and HCA alternating."""
    return [HCA] * min(layers, 2) + [CSA if i % 2 else HCA for i in range(max(layers - 2, 0))]


def check_output_groups(shape, tp: int) -> None:
    """The grouped output projection splits by whole groups: ``o_groups % tp == 0``."""
    if shape.o_groups % tp:
        valid = [t for t in range(1, shape.o_groups + 1) if shape.o_groups % t == 0]
        raise ConfigError(f"deepseek_v4 splits its grouped output projection by whole groups: o_groups="
                          f"{shape.o_groups} is not divisible by tp={tp}; valid tp: {valid}")


def weight_params_per_rank(shape, tp: int, experts: str = "sharded") -> int:
    """Parameters one rank holds (module docstring); at ``tp = 1`` every parameter of HF's model."""
    if experts not in ("sharded", "replicated"):
        raise ValueError(f"experts must be 'sharded' or 'replicated', got {experts!r}")
    hid, hq, d, qr = shape.hidden_size, shape.num_q_heads, shape.head_dim, shape.q_lora_rank
    di, ih, hc = shape.index_head_dim, shape.index_heads, shape.hc_mult
    split = lambda n: math.ceil(n / tp)  # noqa: E731
    rates = dict(shape.compress_rates)
    total = split(shape.vocab_size) * hid * (1 if shape.tie_embeddings else 2) + hid
    total += hc * hc * hid + hc + 1  # the head's hyper-connection mixer
    attention = split(hq) + hid * qr + qr + split(qr * hq * d) + hid * d + d
    attention += split(shape.o_lora_rank * hq * d) + hid * split(shape.o_groups * shape.o_lora_rank)
    mixers = 2 * ((2 + hc) * hc * hc * hid + (2 + hc) * hc + 3)
    routed = 3 * hid * shape.moe_intermediate_size * shape.n_routed_experts
    moe = (split(routed) if experts == "sharded" else routed) + shape.n_routed_experts * hid
    moe += split(3 * hid * shape.moe_intermediate_size * shape.n_shared_experts)
    for kind in shape.layer_types:
        total += 2 * hid + attention + mixers + moe
        if kind == HCA:
            total += _compressor(rates[kind], d, d, hid)
        elif kind == CSA:
            m = rates[kind]
            total += _compressor(m, 2 * d, d, hid) + _compressor(m, 2 * di, di, hid) + qr * ih * di + hid * ih
    return total


def _compressor(rate: int, width: int, dim: int, hid: int) -> int:
    """Position bias ``[m, width]``, value and gate projections ``hid → width``, the entry norm."""
    return rate * width + 2 * hid * width + dim
