"""Front end for HF transformers causal LMs: facts from the config, graph from ``torch.export``.

The model's forward is exported non-strict with a dynamic token count, on the convention
``(input_ids [1, T], position_ids [1, T]) -> logits [1, T, V]``: one flattened token sequence with
explicit positions, which continuous batching relies on. Parameters, buffers and constants are
lifted to explicit placeholders. Nothing here is per-model code: the attention kind, head counts
and dims come from the config (MLA is recognised by ``kv_lora_rank``), the TP plan from
``config.base_model_tp_plan``, and attention nodes from the registered attention implementation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re

import torch
import torch.fx

from ..errors import UnsupportedModelError
from ..program import ModelFacts, Program
from .compressed_layers import canonical_compressed_layers, compress_rates, compressed_modules
from .compressed_tp import output_groups, v4_attention_tp_plan
from .export import TokenShapeRefusal, finish, program_from_export, run_export
from .head_sharding import head_sharded_attention
from .hf_attention import recording_attention_callers, using_dcpgraph_attention
from .layer_kinds import check_layer_types, require_attention_in_every_layer
from .layer_shapes import config_per_layer, differing
from .recurrent_layers import (
    canonical_recurrent_layers,
    recurrent_modules,
    stateless_layers,
    unrecognised_recurrent_layers,
)
from .score_scaled_experts import traceable_score_scaled_experts

WRAPPER_PREFIX = "model."
"""The prefix :class:`LogitsForward` adds to every parameter and buffer name of the wrapped model
in the exported graph; :func:`~.export.program_from_export` strips it, so ``Program.state`` is
keyed by the HF model's own names (the checkpoint's)."""


class LogitsForward(torch.nn.Module):
    """``(input_ids [1, T], position_ids [1, T]) -> logits [1, T, V]`` around an HF causal LM (no
    KV cache of HF's own): the signature every front end exports. The model is the submodule
    ``model``, hence :data:`WRAPPER_PREFIX`."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits


def is_hf_model(model: object) -> bool:
    config = getattr(model, "config", None)
    return config is not None and hasattr(config, "model_type") and hasattr(model, "set_attn_implementation")


def model_facts(model: torch.nn.Module) -> ModelFacts:
    cfg = model.config
    text = _GlobalAttributes(cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg)
    if getattr(text, "num_attention_heads", None) is None:
        raise UnsupportedModelError(
            f"{type(model).__name__}: the config has no num_attention_heads: not an attention model "
            "(recurrent architectures such as RWKV or xLSTM are not supported)"
        )
    heads = text.num_attention_heads
    mla = getattr(text, "kv_lora_rank", None) is not None
    layer_kv = None if mla else config_per_layer(text, "num_key_value_heads")
    kv_heads = (layer_kv[0] if layer_kv else getattr(text, "num_key_value_heads", None)) or heads
    if mla:
        head_dim = text.qk_nope_head_dim + text.qk_rope_head_dim
        v_head_dim = text.v_head_dim
        extra = {
            "kv_lora_rank": text.kv_lora_rank,
            "qk_rope_head_dim": text.qk_rope_head_dim,
            "qk_nope_head_dim": text.qk_nope_head_dim,
            "q_lora_rank": getattr(text, "q_lora_rank", None),
        }
    else:
        layer_dims = config_per_layer(text, "head_dim")
        head_dim = layer_dims[0] if layer_dims else (getattr(text, "head_dim", None) or text.hidden_size // heads)
        v_head_dim = head_dim
        extra = {}
    extra["max_position_embeddings"] = getattr(text, "max_position_embeddings", None)
    extra["ep_plan"] = ep_plan(model)
    extra["num_nextn_predict_layers"] = int(getattr(text, "num_nextn_predict_layers", 0) or 0)  # MTP layers
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = getattr(text, "eos_token_id", None)
    eos_ids = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
    plan = tp_plan(model)
    dtype = next(model.parameters()).dtype
    return ModelFacts(
        architecture=type(model).__name__,
        attention="mla" if mla else "gqa",
        num_layers=text.num_hidden_layers,
        num_q_heads=heads,
        num_kv_heads=1 if mla else kv_heads,
        head_dim=head_dim,
        v_head_dim=v_head_dim,
        vocab_size=text.vocab_size,
        hidden_size=text.hidden_size,
        dtype=dtype,
        eos_token_id=eos_ids,
        tp_plan=plan,
        extra=extra,
        layer_kv_heads=differing(layer_kv or ()),
        layer_head_dims=() if mla else differing(layer_dims or ()),
    )


class _GlobalAttributes:
    """Read-through view of a config that refuses by name an attribute transformers declares
    per-layer (one value per decoder layer) where dcpgraph needs one value for the whole model;
    ``head_dim`` and ``num_key_value_heads`` are read per layer instead (:mod:`.layer_shapes`)."""

    def __init__(self, config):
        self._config = config

    def __getattr__(self, name: str):
        try:
            return getattr(self._config, name)
        except AttributeError:
            raise
        except Exception as exc:
            if "per-layer" not in str(exc):
                raise
            raise UnsupportedModelError(
                f"per-layer {name} (it varies across decoder layers) is not supported: dcpgraph takes "
                "per-layer head_dim and num_key_value_heads of GQA layers; every other attribute (MLA ranks "
                "and head dims, query heads) needs one value for the whole model"
            ) from exc


def tp_plan(model: torch.nn.Module) -> dict[str, str]:
    """The model's TP plan with full parameter paths: the config's ``base_model_tp_plan`` under
    the base model's prefix, the class's own ``_tp_plan`` (the LM head), and vocab-parallel
    input embeddings; attention with q/k/v and output projections is sharded by head whatever
    the config plans for it (:func:`~.head_sharding.head_sharded_attention`; DeepSeek-V4's by
    :func:`~.compressed_tp.v4_attention_tp_plan`)."""
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    prefix = base_model_path(model)
    plan = {f"{prefix}.{k}": v for k, v in (getattr(text, "base_model_tp_plan", None) or {}).items()}
    plan.update(getattr(type(model), "_tp_plan", None) or {})
    return {**v4_attention_tp_plan(model), **head_sharded_attention(model, plan), **tensor_parallel_experts(model, plan)}


def base_model_path(model: torch.nn.Module) -> str:
    """The attribute holding the base model, which the config's plans are relative to: the class's
    ``base_model_prefix`` where the model has it, else ``model`` (Llama-4's causal LM declares
    ``language_model`` but keeps its decoder at ``model``)."""
    prefix = getattr(model, "base_model_prefix", "model")
    if not isinstance(getattr(model, prefix, None), torch.nn.Module) and isinstance(
            getattr(model, "model", None), torch.nn.Module):
        return "model"
    return prefix


ROUTED_EXPERTS_STYLES = {"gate_up_proj": "packed_colwise", "down_proj": "rowwise", "": "moe_tp_experts"}


def tensor_parallel_experts(model: torch.nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """Plan entries for fused routed experts that ``plan`` says nothing about (transformers 5.25
    dropped them from the MoE configs' ``base_model_tp_plan``, keeping only the EP plan): the
    ``[E, 2I, H]`` gate/up stack column-parallel per half, ``[E, H, I]`` down row-parallel, and
    one all-reduce at the experts' output, as 5.24's plans say. Empty when ``plan`` names any
    experts entry, or when any experts module is laid out otherwise (transposed or interleaved
    gate/up as GPT-OSS's, unfused experts, biases), which then stays replicated."""
    if any(".experts" in key for key in plan):
        return {}
    patterns = set()
    for name, module in model.named_modules():
        if not name.endswith("experts") or not hasattr(module, "gate_up_proj"):
            continue
        gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
        fused = (isinstance(gate_up, torch.nn.Parameter) and isinstance(down, torch.nn.Parameter)
                 and gate_up.dim() == 3 and down.dim() == 3)
        standard = (getattr(module, "has_gate", False) and getattr(module, "is_concatenated", False)
                    and not getattr(module, "is_transposed", True) and not getattr(module, "has_bias", True))
        if not (fused and standard):
            return {}
        patterns.add(re.sub(r"(^|\.)layers\.\d+\.", r"\1layers.*.", name))
    return {f"{pattern}.{part}" if part else pattern: style
            for pattern in sorted(patterns) for part, style in ROUTED_EXPERTS_STYLES.items()}


def ep_plan(model: torch.nn.Module) -> dict[str, str]:
    """The config's ``base_model_ep_plan`` (expert parallelism) under the base model's prefix."""
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    prefix = base_model_path(model)
    return {f"{prefix}.{k}": v for k, v in (getattr(text, "base_model_ep_plan", None) or {}).items()}


def default_example_inputs(facts: ModelFacts, tokens: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, facts.vocab_size, (1, tokens), generator=gen)
    return ids, torch.arange(tokens).unsqueeze(0)


TRACED_EXPERTS = "batched_mm"
"""The experts implementation every trace runs: HF's ``batched_mm`` gathers each routed (token,
expert) pair's weights and evaluates it as one batched matmul, so an experts module is one
data-independent subgraph with one output (what ``moe_tp_experts`` all-reduces and expert
parallelism masks). ``eager`` loops over the experts hit (data-dependent), ``grouped_mm`` sorts
tokens by expert and splits the output by offsets (several outputs; no fp64 kernel; device
checks under fake tensors), hub kernels are opaque."""

LOAD_TIME_EXPERTS = frozenset({"deepgemm_megamoe"})
"""Implementations that rewrite the expert weights into their own layout when the model is
loaded: the parameters no longer hold the checkpoint's values, so no other implementation may run
on them."""


def _experts_configs(model: torch.nn.Module) -> list:
    """Every distinct config a module of ``model`` dispatches its experts implementation from."""
    seen: dict[int, object] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_experts_implementation_internal"):
            seen.setdefault(id(config), config)
    return list(seen.values())


@contextlib.contextmanager
def traceable_experts(model: torch.nn.Module):
    """Run the experts of ``model`` as :data:`TRACED_EXPERTS` inside the block, whatever
    implementation the model was loaded or set with (``eager``, ``grouped_mm``, ``batched_mm``,
    a registered hub kernel); every config's own setting is restored on exit, so the user's model
    is unchanged. All implementations compute the same function of the same weights, except the
    :data:`LOAD_TIME_EXPERTS`, which are refused by name."""
    configs = [c for c in _experts_configs(model) if c._experts_implementation_internal is not None]
    for config in configs:
        if config._experts_implementation_internal in LOAD_TIME_EXPERTS:
            raise UnsupportedModelError(
                f"experts implementation {config._experts_implementation_internal!r} rewrites the expert "
                "weights into its own layout at load time; load the model with "
                f"experts_implementation in {sorted({'eager', 'grouped_mm', 'batched_mm'})} for dcpgraph"
            )
    saved = [(c, c._experts_implementation_internal) for c in configs]
    try:
        for config, _ in saved:
            config._experts_implementation_internal = TRACED_EXPERTS
        yield
    finally:
        for config, value in saved:
            config._experts_implementation_internal = value


def min_trace_tokens(model: torch.nn.Module) -> int:
    """The fewest tokens the export's dynamic dim allows: 2, or a sparse-attention indexer's
    ``index_topk`` (HF's indexer takes ``topk(min(index_topk, T))``, a guard export cannot prove for
    every ``T``; from ``index_topk`` tokens on it is the constant ``index_topk``), or twice
    DeepSeek-V4's largest compress rate (export specialises an entry count ``T // m`` of 0 or 1;
    from ``2m`` tokens on every layer has at least two entries). The traced graph still runs at any
    token count: canonicalize replaces that top-k by ``dcpgraph.indexer_topk``, and the compressed
    ops take any number of entries."""
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    rates = getattr(text, "compress_rates", None)
    compressed = 2 * max(rates.values()) if isinstance(rates, dict) and rates else 0
    return max(2, int(getattr(text, "index_topk", 0) or 0), compressed)


def export_program(model: torch.nn.Module, example_inputs: tuple[torch.Tensor, torch.Tensor],
                   max_tokens: int = 1 << 16) -> Program:
    """``torch.export`` of :class:`LogitsForward` around ``model`` (eval mode, dcpgraph's attention,
    :func:`traceable_experts`; the model's training flag is restored), with a dynamic token count
    in ``[min_trace_tokens(model), max_tokens]``, as a :class:`~dcpgraph.program.Program` before :func:`~.export.finish`
    (callers that rewrite the graph first, like the meta-device loader, finish it themselves).
    Layer kinds other than causal full/sliding attention are refused by name before anything runs."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    types = list(getattr(config, "layer_types", None) or ())
    recognised = set(recurrent_modules(model)) - set(unrecognised_recurrent_layers(model, types))
    stateless = stateless_layers(model, types)
    compressed_found = set(compressed_modules(model))
    check_layer_types(config, recognised | set(stateless) | compressed_found)
    facts = model_facts(model)
    low = min_trace_tokens(model)
    tokens = torch.export.Dim("tokens", min=low, max=max(max_tokens, low + 1))
    was_training = model.training
    model.eval()
    try:
        with using_dcpgraph_attention(model), traceable_experts(model), traceable_score_scaled_experts(model), \
                torch.no_grad(), recording_attention_callers() as callers, \
                canonical_recurrent_layers(model) as recurrent, canonical_compressed_layers(model) as compressed:
            try:
                exported, seconds = run_export(
                    LogitsForward(model).eval(), tuple(example_inputs),
                    {"input_ids": {1: tokens}, "position_ids": {1: tokens}},
                )
            except TokenShapeRefusal:  # the forward ran to its end: a layer without attention says why
                if callers:
                    require_attention_in_every_layer(
                        facts.num_layers, [*callers.values(), *recurrent, *stateless, *compressed], facts.architecture)
                raise
    finally:
        model.train(was_training)
    if recurrent:
        facts = dataclasses.replace(facts, extra={**facts.extra, "recurrent_layers": dict(sorted(recurrent.items()))})
    if stateless:
        facts = dataclasses.replace(facts, extra={**facts.extra, "stateless_layers": stateless})
    if compressed:  # DeepSeek-V4's CSA/HCA layers (dcpgraph.compressed_attention)
        facts = dataclasses.replace(facts, extra={**facts.extra, "compressed_layers": dict(sorted(compressed.items())),
                                                  "o_groups": output_groups(model),
                                                  "compress_rates": compress_rates(model)})
    beside = sorted(set(recurrent) & {i for i in callers.values() if i is not None})
    if beside:  # falcon_h1: attention and a Mamba-2 mixer in parallel in one decoder layer
        facts = dataclasses.replace(facts, extra={**facts.extra, "attention_beside_recurrent": beside})
    return program_from_export(exported, facts, prefix=WRAPPER_PREFIX, seconds=seconds)


def trace_hf(model: torch.nn.Module, example_inputs=None, max_tokens: int = 1 << 16) -> Program:
    """:func:`export_program` then :func:`~.export.finish`; refuses, after export, any decoder
    layer that called no attention."""
    if example_inputs is None:
        example_inputs = default_example_inputs(model_facts(model), tokens=max(8, min_trace_tokens(model) + 1))
    program = finish(export_program(model, example_inputs, max_tokens))
    facts = program.facts
    kinds = (torch.ops.dcpgraph.attention.default, torch.ops.dcpgraph.sparse_attention.default,
             torch.ops.dcpgraph.causal_conv1d.default,  # one conv per conv-carrying recurrent layer
             torch.ops.dcpgraph.lightning_attention.default,
             torch.ops.dcpgraph.compressed_attention.default)
    layers = [n for n in program.graph_module.graph.nodes if n.op == "call_function" and n.target in kinds]
    layers += facts.extra.get("stateless_layers") or []  # attention-free MLP/MoE layers (nemotron_h)
    require_attention_in_every_layer(facts.num_layers, [None] * len(layers), facts.architecture)
    return program
