"""Front end for HF transformers causal LMs: facts from the config, graph from ``torch.export``.

The model's forward is exported non-strict with a dynamic token count, on the convention
``(input_ids [1, T], position_ids [1, T]) -> logits [1, T, V]``: one flattened token sequence with
explicit positions, which continuous batching relies on. Parameters, buffers and constants are
lifted to explicit placeholders. Nothing here is per-model code: the attention kind, head counts
and dims come from the config (MLA is recognised by ``kv_lora_rank``), the TP plan from
``config.base_model_tp_plan``, and attention nodes from the registered attention implementation.
"""

from __future__ import annotations

import torch
import torch.fx

from ..errors import UnsupportedModelError
from ..program import BUFFER, CONSTANT, PARAM, USER, InputSpec, ModelFacts, Program
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


def default_example_inputs(facts: ModelFacts, tokens: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, facts.vocab_size, (1, tokens), generator=gen)
    return ids, torch.arange(tokens).unsqueeze(0)


def trace_hf(model: torch.nn.Module, example_inputs=None, max_tokens: int = 1 << 16) -> Program:
    facts = model_facts(model)
    if example_inputs is None:
        example_inputs = default_example_inputs(facts)
    tokens = torch.export.Dim("tokens", min=2, max=max_tokens)
    wrapper = _Forward(model).eval()
    was_training = model.training
    model.eval()
    try:
        with using_dcpgraph_attention(model), torch.no_grad():
            exported = torch.export.export(
                wrapper,
                tuple(example_inputs),
                dynamic_shapes={"input_ids": {1: tokens}, "position_ids": {1: tokens}},
                strict=False,
            )
    except UnsupportedModelError:
        raise
    except Exception as err:
        cause = err
        while cause.__cause__ is not None or cause.__context__ is not None:
            nxt = cause.__cause__ or cause.__context__
            if isinstance(nxt, UnsupportedModelError):
                raise nxt from err
            cause = nxt
        raise
    finally:
        model.train(was_training)
    return _program_from_export(exported, facts)


def _program_from_export(exported: torch.export.ExportedProgram, facts: ModelFacts) -> Program:
    from torch.export.graph_signature import InputKind

    kinds = {
        InputKind.PARAMETER: PARAM,
        InputKind.BUFFER: BUFFER,
        InputKind.CONSTANT_TENSOR: CONSTANT,
        InputKind.USER_INPUT: USER,
    }
    state: dict[str, torch.Tensor] = {}
    specs = []
    user_roles = iter(("input_ids", "position_ids"))
    for s in exported.graph_signature.input_specs:
        if s.kind not in kinds:
            raise UnsupportedModelError(f"exported input {s.arg.name} of kind {s.kind} is not supported")
        kind = kinds[s.kind]
        if kind == USER:
            specs.append(InputSpec(s.arg.name, USER, next(user_roles)))
            continue
        target = s.target.removeprefix(_WRAPPER_PREFIX)
        value = exported.state_dict.get(s.target)
        if value is None:
            value = exported.constants[s.target]
        state[target] = value.detach()
        specs.append(InputSpec(s.arg.name, kind, target))
    if exported.graph_signature.buffers_to_mutate:
        raise UnsupportedModelError(
            f"the model mutates buffers {list(exported.graph_signature.buffers_to_mutate.values())}"
        )
    gm = exported.graph_module
    # Drop export's runtime assertion ops: the shape contracts they check are ours to keep.
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in (
            torch.ops.aten._assert_tensor_metadata.default,
            torch.ops.aten._assert_scalar.default,
        ):
            graph.erase_node(node)
    graph.eliminate_dead_code()
    gm.recompile()
    plain = torch.fx.GraphModule(gm, graph)
    return Program(graph_module=plain, inputs=tuple(specs), facts=facts, state=state)
