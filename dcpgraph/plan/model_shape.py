"""A model's shapes from its HF config (a local directory, a dict, a ``PretrainedConfig``, or a
named architecture from :mod:`.architectures`): what the planner needs, no weights.

Per-rank caches follow the compiler exactly: GQA has a K and a V cache per layer with
``local_kv_heads(num_kv_heads, tp)`` heads (the KV heads are replicated when ``tp > num_kv_heads``,
the rule ``shard_tp`` uses, :func:`dcpgraph.mesh.local_kv_heads`); MLA has one latent head of ``kv_lora_rank + qk_rope_head_dim``
per layer on every rank. DeepSeek-V3.2's indexer key cache (not compiled by dcpgraph; modelled
here) is one head of ``index_head_dim`` per layer, stored fp8 with one fp32 scale per token, as
DeepSeek's and vLLM's implementations store it.

Weights per rank (:meth:`ModelShape.weight_params_per_rank`), the sharding assumed:

* column/row-parallel pieces are split by ``tp``: query/output projections (by head), GQA K/V
  projections by KV head (one whole head per rank when ``tp > num_kv_heads``), MLA's ``q_b_proj``
  / ``kv_b_proj`` / ``o_proj``, dense MLPs and shared experts (by intermediate), the embedding and
  LM head (vocab-parallel, rounded up);
* replicated on every rank: norms, MLA's down projections ``q_a_proj`` / ``kv_a_proj_with_mqa``,
  the MoE router;
* routed experts: ``experts="sharded"`` splits them by ``tp`` (expert or tensor parallel: what
  vLLM, SGLang and dcpgraph's compiler do, ``enable_expert_parallel`` choosing which),
  ``experts="replicated"`` keeps all of them on every rank (for comparison).

Gated-delta-net hybrids (``qwen3_next``, ``qwen3_5``/``qwen3_5_text``): only the
``full_attention`` layers of ``layer_types`` (or every ``full_attention_interval``-th layer) have
KV caches; every other layer keeps a fixed recurrent state per request, whose bytes on one rank are
:meth:`dcpgraph.recurrent_state.GatedDeltaNetShape.state_bytes_per_request` (split over ``tp``
where it divides the key heads, else replicated), what the compiled program's pools hold. The
gated attention's query projection is twice as wide (its output gate). Other recurrent kinds
(short convolution, Mamba-2, …) are refused by name.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from ..capacity import FP8_SCALE_BYTES, CacheShape, scale_groups
from ..errors import UnsupportedModelError
from ..mesh import local_kv_heads
from ..recurrent_state import GatedDeltaNetShape
from . import compressed_model
from .architectures import named_config

KV_CACHE_DTYPES = ("auto", "bf16", "fp16", "fp32", "fp8_e4m3")
_DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "bf16": 2, "fp16": 2,
                "fp32": 4, "fp64": 8, "fp8": 1, "fp8_e4m3": 1}
def fp8_scale_bytes(dim: int) -> int:
    """Scale bytes per (token, head) of an fp8_e4m3 cache: one fp32 scale per group of
    ``capacity.FP8_SCALE_GROUP`` elements, what the compiler's fp8 cache stores (:mod:`dcpgraph.ops.quant`)."""
    return scale_groups(dim) * FP8_SCALE_BYTES


@dataclass(frozen=True)
class ModelShape:
    name: str
    attention: str  # "gqa" | "mla" | "compressed" (DeepSeek-V4: :mod:`.compressed_model`)
    num_layers: int
    hidden_size: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int  # query/key dim of the cached attention (MLA: latent + rope, absorbed)
    v_head_dim: int  # value dim of the cached attention (MLA: kv_lora_rank)
    vocab_size: int
    dtype_bytes: int
    intermediate_size: int = 0
    moe_layers: int = 0
    n_routed_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    n_shared_experts: int = 0
    router_bias: bool = False
    tie_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    mla_v_head_dim: int = 0
    index_head_dim: int = 0
    index_heads: int = 0
    index_topk: int = 0  # DSA: attention reads this many tokens per query (0: dense attention)
    # DeepSeek-V4 (attention == "compressed"): its raw window, layer kinds, rates, output groups
    sliding_window: int = 0
    layer_types: tuple[str, ...] = ()
    compress_rates: tuple[tuple[str, int], ...] = ()
    o_groups: int = 0
    o_lora_rank: int = 0
    hc_mult: int = 0

    def compressed_config(self) -> dict:
        """The fields :func:`~.compressed_cache.compressed_cache_bytes` reads (V4 only)."""
        return {"head_dim": self.head_dim, "index_head_dim": self.index_head_dim,
                "sliding_window": self.sliding_window, "compress_rates": dict(self.compress_rates),
                "layer_types": list(self.layer_types)}
    # gated-delta-net hybrids: the layers that are gated delta nets (the rest are attention layers)
    gated_delta_net: GatedDeltaNetShape | None = None
    recurrent_layers: int = 0
    attention_output_gate: bool = False  # qwen3_next / qwen3_5: the query projection also yields a gate

    @property
    def attention_layers(self) -> int:
        """Layers with a KV cache (every layer but the recurrent ones)."""
        return self.num_layers - self.recurrent_layers

    def recurrent_state_bytes_per_request(self, tp: int) -> int:
        """One request's recurrent state on one rank, all recurrent layers (0 without)."""
        if self.gated_delta_net is None:
            return 0
        dtype = {2: torch.bfloat16, 4: torch.float32, 8: torch.float64}[self.dtype_bytes]
        return self.recurrent_layers * self.gated_delta_net.state_bytes_per_request(dtype, tp)

    # -- KV caches ---------------------------------------------------------------------------
    def kv_element_bytes(self, kv_cache_dtype: str) -> int:
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
        return self.dtype_bytes if kv_cache_dtype == "auto" else _DTYPE_BYTES[kv_cache_dtype]

    def kv_heads_per_rank(self, tp: int) -> int:
        return 1 if self.attention in ("mla", "compressed") else local_kv_heads(self.num_kv_heads, tp)

    def cache_shapes(self, tp: int, kv_cache_dtype: str = "auto") -> list[CacheShape]:
        """Every cache of one rank, layer by layer (the compiled program's ``caches``)."""
        if self.attention == "compressed":
            raise UnsupportedModelError(
                f"{self.name}: DeepSeek-V4's caches are not per-token paged caches; their bytes are "
                "dcpgraph.plan.compressed_cache.compressed_cache_bytes(shape.compressed_config(), ...)")
        b = self.kv_element_bytes(kv_cache_dtype)

        def shape(heads: int, dim: int) -> CacheShape:
            scale = fp8_scale_bytes(dim) if kv_cache_dtype == "fp8_e4m3" else 0
            return CacheShape(heads, dim, b, scale)

        per_layer: list[CacheShape] = []
        if self.attention == "mla":
            per_layer.append(shape(1, self.head_dim))
            if self.index_head_dim:
                per_layer.append(CacheShape(1, self.index_head_dim, 1, FP8_SCALE_BYTES))
        else:
            h = self.kv_heads_per_rank(tp)
            per_layer += [shape(h, self.head_dim), shape(h, self.v_head_dim)]
        return per_layer * self.attention_layers

    def q_heads_per_rank(self, tp: int) -> int:
        return self.num_q_heads // tp

    # -- weights -----------------------------------------------------------------------------
    def weight_params_per_rank(self, tp: int, experts: str = "sharded", dcp: int = 1, comm: str = "a2a") -> int:
        """Parameters held by one rank at tensor parallel ``tp`` (sharding: module docstring).
        ``comm="ag"`` (GQA) holds the query projection of its DCP group's heads (``dcp`` times its
        TP shard) and, at ``dcp == tp``, the whole output projection."""
        if self.attention == "compressed":
            return compressed_model.weight_params_per_rank(self, tp, experts)
        if experts not in ("sharded", "replicated"):
            raise ValueError(f"experts must be 'sharded' or 'replicated', got {experts!r}")
        hid, hq = self.hidden_size, self.num_q_heads
        split = lambda n: math.ceil(n / tp)  # noqa: E731
        vocab = split(self.vocab_size) * hid
        total = vocab * (1 if self.tie_embeddings else 2) + hid  # embedding, LM head, final norm
        per_layer = 2 * hid  # input and post-attention norms
        if self.attention == "mla":
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            if self.q_lora_rank:
                per_layer += hid * self.q_lora_rank + self.q_lora_rank + split(self.q_lora_rank * hq * qk)
            else:
                per_layer += split(hid * hq * qk)
            per_layer += hid * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
            per_layer += split(self.kv_lora_rank * hq * (self.qk_nope_head_dim + self.mla_v_head_dim))
            per_layer += split(hq * self.mla_v_head_dim * hid)
        else:
            hkv = self.kv_heads_per_rank(tp)
            d, dv = self.head_dim, self.v_head_dim
            group = dcp if comm == "ag" else 1  # query heads computed here: the DCP group's
            per_layer += group * split(hq * d * (2 if self.attention_output_gate else 1)) * (hid + self.attention_bias)
            per_layer += hkv * (d + dv) * (hid + self.attention_bias)
            o_proj = hq * dv if comm == "ag" and dcp == tp else split(hq * dv)
            per_layer += o_proj * hid + (2 * d if self.qk_norm else 0)
        dense_layers = self.num_layers - self.moe_layers
        total += per_layer * self.attention_layers + self.recurrent_layers * (2 * hid + self._gdn_params(tp))
        total += dense_layers * split(3 * hid * self.intermediate_size)
        if self.moe_layers:
            routed = 3 * hid * self.moe_intermediate_size * self.n_routed_experts
            moe = (split(routed) if experts == "sharded" else routed)
            moe += self.n_routed_experts * hid + (self.n_routed_experts if self.router_bias else 0)
            moe += split(3 * hid * self.moe_intermediate_size * self.n_shared_experts)
            total += self.moe_layers * moe
        return total

    def _gdn_params(self, tp: int) -> int:
        """One gated delta net's parameters on a rank: the projections to ``q, k, v, z`` and to
        ``b, a``, the conv over ``q, k, v``, ``A_log``/``dt_bias``, the per-head norm and
        ``out_proj`` (split with the key heads, the norm replicated)."""
        g = self.gated_delta_net
        if g is None:
            return 0
        local, hid = g.on_rank(tp), self.hidden_size
        projections = hid * (local.conv_channels + local.value_heads * local.value_dim + 2 * local.value_heads)
        return (projections + local.conv_channels * local.conv_kernel + 2 * local.value_heads + local.value_dim
                + local.value_heads * local.value_dim * hid)

    def routed_expert_params_per_rank(self, tp: int, experts: str = "sharded") -> int:
        """The routed experts' share of :meth:`weight_params_per_rank`."""
        routed = 3 * self.hidden_size * self.moe_intermediate_size * self.n_routed_experts
        return self.moe_layers * (math.ceil(routed / tp) if experts == "sharded" else routed)

    def weight_bytes_per_rank(self, tp: int, weight_bytes: float | None = None, experts: str = "sharded") -> int:
        return int(self.weight_params_per_rank(tp, experts) * (weight_bytes or self.dtype_bytes))


def _dtype_bytes(config: dict, override) -> int:
    if override is not None:
        if isinstance(override, int):
            return override
        return _DTYPE_BYTES[str(override).replace("torch.", "")]
    name = config.get("torch_dtype") or config.get("dtype") or "bfloat16"
    return _DTYPE_BYTES.get(str(name).replace("torch.", ""), 2)


def _moe_layers(c: dict, layers: int) -> int:
    if c.get("n_routed_experts"):  # DeepSeek family
        first, freq = int(c.get("first_k_dense_replace") or 0), int(c.get("moe_layer_freq") or 1)
        return sum(1 for i in range(layers) if i >= first and i % freq == 0)
    if c.get("num_experts"):  # Qwen MoE family
        step, dense = int(c.get("decoder_sparse_step") or 1), set(c.get("mlp_only_layers") or [])
        return sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0)
    return 0


PER_LAYER_SHAPE_KEYS = ("per_layer_config", "global_head_dim", "num_global_key_value_heads", "swa_num_key_value_heads")
"""Config keys that give some attention layers their own head dim or KV head count (Gemma-4's
global layers, a heterogeneous config's per-layer entries)."""
PER_LAYER_SHAPE_MODELS = {"mimo_v2_flash": "its sliding layers have twice the full layers' KV heads"}
"""Model types whose modeling code (not their config) gives layers different KV shapes."""


def _refuse_per_layer_shapes(c: dict) -> None:
    """The planner models one ``[kv_heads, head_dim]`` for every layer: refuse, by name, a config
    whose layers differ (the compiled program sizes them per layer; ``Engine.memory_report``)."""
    keys = [k for k in PER_LAYER_SHAPE_KEYS if c.get(k)]
    why = PER_LAYER_SHAPE_MODELS.get(c.get("model_type", ""))
    if keys or why:
        raise UnsupportedModelError(
            f"{c.get('model_type', 'model')}: the planner models one KV head count and head dim for every layer, and "
            f"this model's layers differ ({why or 'config keys ' + ', '.join(keys)}); compile it and read "
            "Engine.memory_report(), which sums each layer's cache"
        )


def from_config(config: dict, *, name: str | None = None, dtype=None) -> ModelShape:
    """A :class:`ModelShape` from an HF config dict (``dtype``: override the stored dtype)."""
    c = config
    layers, hid, hq = int(c["num_hidden_layers"]), int(c["hidden_size"]), int(c["num_attention_heads"])
    common = dict(
        name=name or c.get("name") or c.get("model_type", "model"), num_layers=layers, hidden_size=hid,
        num_q_heads=hq, vocab_size=int(c["vocab_size"]), dtype_bytes=_dtype_bytes(c, dtype),
        intermediate_size=int(c.get("intermediate_size") or 0), moe_layers=_moe_layers(c, layers),
        n_routed_experts=int(c.get("n_routed_experts") or c.get("num_experts") or 0),
        experts_per_token=int(c.get("num_experts_per_tok") or 0),
        moe_intermediate_size=int(c.get("moe_intermediate_size") or 0),
        n_shared_experts=int(c.get("n_shared_experts") or 0),
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
    )
    if c.get("model_type") == "deepseek_v4":
        return _deepseek_v4(c, common)
    if c.get("kv_lora_rank"):
        latent, rope = int(c["kv_lora_rank"]), int(c["qk_rope_head_dim"])
        return ModelShape(
            attention="mla", num_kv_heads=1, head_dim=latent + rope, v_head_dim=latent,
            q_lora_rank=int(c.get("q_lora_rank") or 0), kv_lora_rank=latent, qk_rope_head_dim=rope,
            qk_nope_head_dim=int(c["qk_nope_head_dim"]), mla_v_head_dim=int(c["v_head_dim"]),
            router_bias=c.get("model_type") in ("deepseek_v3", "kimi_k2", "deepseek_v32"),
            index_head_dim=int(c.get("index_head_dim") or 0), index_heads=int(c.get("index_n_heads") or 0),
            index_topk=int(c.get("index_topk") or 0), **common,
        )
    _refuse_per_layer_shapes(c)
    d = int(c.get("head_dim") or hid // hq)
    model_type = c.get("model_type", "")
    return ModelShape(
        attention="gqa", num_kv_heads=int(c.get("num_key_value_heads") or hq), head_dim=d, v_head_dim=d,
        attention_bias=bool(c.get("attention_bias", model_type == "qwen2")),
        qk_norm=model_type.startswith("qwen3"), **_gated_delta_net_fields(c, layers), **common,
    )


def _deepseek_v4(c: dict, common: dict) -> ModelShape:
    """V4: one shared K=V head of ``head_dim`` per layer, every layer MoE (hash or learned routing)."""
    common.update(moe_layers=common["num_layers"], intermediate_size=0)
    d = int(c.get("head_dim") or 512)
    return ModelShape(
        attention="compressed", num_kv_heads=1, head_dim=d, v_head_dim=d, q_lora_rank=int(c.get("q_lora_rank") or 0),
        index_head_dim=int(c.get("index_head_dim") or 128), index_heads=int(c.get("index_n_heads") or 64),
        index_topk=int(c.get("index_topk") or 512), **compressed_model.compressed_fields(c), **common,
    )
GATED_DELTA_NET_MODELS = ("qwen3_next", "qwen3_5", "qwen3_5_text")
OTHER_RECURRENT_MODELS = ("lfm2", "lfm2_moe", "bamba", "nemotron_h", "granitemoehybrid", "falcon_h1", "jamba",
                          "mamba", "mamba2", "zamba", "zamba2", "kimi_linear", "minimax", "plamo2")


def _gated_delta_net_fields(c: dict, layers: int) -> dict:
    """The recurrent fields of a gated-delta-net hybrid's :class:`ModelShape` (none for a plain
    transformer); any other recurrent kind is refused by name."""
    model_type = c.get("model_type", "")
    kinds = set(c.get("layer_types") or ()) - {"full_attention", "sliding_attention", "attention"}
    if model_type in OTHER_RECURRENT_MODELS or (kinds and model_type not in GATED_DELTA_NET_MODELS):
        raise UnsupportedModelError(
            f"{model_type or 'model'}: the planner models gated-delta-net hybrids ({', '.join(GATED_DELTA_NET_MODELS)}) "
            f"and plain transformers, not this model's recurrent layers{f' ({sorted(kinds)})' if kinds else ''}; "
            "compile it and read Engine.memory_report(), which counts every state pool")
    if model_type not in GATED_DELTA_NET_MODELS:
        return {}
    if c.get("layer_types"):
        recurrent = sum(kind == "linear_attention" for kind in c["layer_types"])
    else:
        interval = int(c.get("full_attention_interval") or 4)
        recurrent = sum((i + 1) % interval != 0 for i in range(layers))
    return {"gated_delta_net": GatedDeltaNetShape.from_config(SimpleNamespace(**c)), "recurrent_layers": recurrent,
            "attention_output_gate": True}


def load_model_shape(source, *, dtype=None) -> ModelShape:
    """``source``: a local HF model directory, a named architecture (``NAME[:key=value,...]``),
    a config dict, or a ``transformers`` config object."""
    if isinstance(source, ModelShape):
        return source
    if isinstance(source, dict):
        return from_config(source, dtype=dtype)
    if hasattr(source, "to_dict"):
        return from_config(source.to_dict(), dtype=dtype)
    if os.path.isdir(source):
        path = os.path.join(source, "config.json")
        if not os.path.exists(path):
            raise ValueError(f"{source!r} has no config.json")
        with open(path) as f:
            return from_config(json.load(f), name=os.path.basename(os.path.normpath(source)), dtype=dtype)
    return from_config(named_config(source), dtype=dtype)
