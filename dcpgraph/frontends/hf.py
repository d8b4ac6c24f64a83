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

import torch
import torch.fx

from ..program import ModelFacts, Program
from .export import finish, program_from_export, run_export
from .hf_attention import using_dcpgraph_attention

_WRAPPER_PREFIX = "model."


class _Forward(torch.nn.Module):
    """``(input_ids, position_ids) -> logits`` around an HF causal LM."""

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
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    mla = getattr(text, "kv_lora_rank", None) is not None
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
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        v_head_dim = head_dim
        extra = {}
    extra["max_position_embeddings"] = getattr(text, "max_position_embeddings", None)
    extra["ep_plan"] = ep_plan(model)
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
    )


def tp_plan(model: torch.nn.Module) -> dict[str, str]:
    """The model's TP plan with full parameter paths: the config's ``base_model_tp_plan`` under
    the base model's prefix, the class's own ``_tp_plan`` (the LM head), and vocab-parallel
    input embeddings."""
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    prefix = getattr(model, "base_model_prefix", "model")
    plan = {f"{prefix}.{k}": v for k, v in (getattr(text, "base_model_tp_plan", None) or {}).items()}
    plan.update(getattr(type(model), "_tp_plan", None) or {})
    return plan


def ep_plan(model: torch.nn.Module) -> dict[str, str]:
    """The config's ``base_model_ep_plan`` (expert parallelism) under the base model's prefix."""
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    prefix = getattr(model, "base_model_prefix", "model")
    return {f"{prefix}.{k}": v for k, v in (getattr(text, "base_model_ep_plan", None) or {}).items()}


def default_example_inputs(facts: ModelFacts, tokens: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, facts.vocab_size, (1, tokens), generator=gen)
    return ids, torch.arange(tokens).unsqueeze(0)


@contextlib.contextmanager
def _traceable_experts(model: torch.nn.Module):
    """MoE experts: HF's ``eager`` loop is data-dependent (untraceable) and ``grouped_mm`` has no
    fp64 kernel, so those trace with ``batched_mm`` (same math, gathers expert weights per token);
    the model's own setting is restored afterwards."""
    current = getattr(model.config, "_experts_implementation", None)
    fp64 = next(model.parameters()).dtype == torch.float64
    switch = current is not None and (current == "eager" or (current == "grouped_mm" and fp64))
    if switch:
        model.set_experts_implementation("batched_mm")
    try:
        yield
    finally:
        if switch:
            model.set_experts_implementation(current)


def min_trace_tokens(model: torch.nn.Module) -> int:
    """The fewest tokens the export's dynamic dim allows: 2, or a sparse-attention indexer's
    ``index_topk`` (HF's indexer takes ``topk(min(index_topk, T))``, a guard export cannot prove for
    every ``T``; from ``index_topk`` tokens on it is the constant ``index_topk``). The traced graph
    still runs at any token count: canonicalize replaces that top-k by ``dcpgraph.indexer_topk``."""
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return max(2, int(getattr(text, "index_topk", 0) or 0))


def trace_hf(model: torch.nn.Module, example_inputs=None, max_tokens: int = 1 << 16) -> Program:
    facts = model_facts(model)
    low = min_trace_tokens(model)
    if example_inputs is None:
        example_inputs = default_example_inputs(facts, tokens=max(8, low + 1))
    tokens = torch.export.Dim("tokens", min=low, max=max(max_tokens, low + 1))
    wrapper = _Forward(model).eval()
    was_training = model.training
    model.eval()
    try:
        with using_dcpgraph_attention(model), _traceable_experts(model), torch.no_grad():
            exported, seconds = run_export(
                wrapper, tuple(example_inputs), {"input_ids": {1: tokens}, "position_ids": {1: tokens}},
            )
    finally:
        model.train(was_training)
    program = program_from_export(exported, facts, prefix=_WRAPPER_PREFIX, seconds=seconds)
    return finish(program)
