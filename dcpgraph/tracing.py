"""``trace``: a model's forward as a functional FX :class:`~dcpgraph.program.Program` whose
attention calls are canonical ``dcpgraph`` attention nodes (HF models through their attention
interface, other modules through SDPA or hand-written attention recognition), and the facts
(:class:`~dcpgraph.program.ModelFacts`) compile checks before tracing."""

from __future__ import annotations

import torch

from .errors import UnsupportedModelError
from .frontends import fx, hf
from .program import Program


def trace(model: torch.nn.Module, example_inputs=None) -> Program:
    """The model's forward as a functional FX Program with canonical attention nodes.

    HF transformers causal LMs go through the registered attention implementation; other
    ``nn.Module``s through SDPA or hand-written attention recognition. Raises
    :class:`UnsupportedModelError` for attention the pipeline cannot implement.
    """

    if hf.is_hf_model(model):
        program = hf.trace_hf(model, example_inputs)
    else:
        program = fx.trace_module(model, example_inputs)
    count = sum(
        1 for n in program.graph_module.graph.nodes
        if n.op == "call_function" and n.target in (torch.ops.dcpgraph.attention.default,
                                                    torch.ops.dcpgraph.sparse_attention.default,
                                                    torch.ops.dcpgraph.compressed_attention.default)
    )
    extra = program.facts.extra
    count += len(extra.get("recurrent_layers") or {}) + len(extra.get("stateless_layers") or [])
    count -= len(extra.get("attention_beside_recurrent") or [])  # one layer holding both
    if count == 0:
        raise UnsupportedModelError(f"{type(model).__name__}: no recognisable attention in the traced graph")
    if count != program.facts.num_layers:
        raise UnsupportedModelError(
            f"{type(model).__name__}: found {count} attention nodes for {program.facts.num_layers} layers; "
            "some attention was not recognised"
        )
    return program


def facts_of(model: torch.nn.Module | Program):
    if isinstance(model, Program):
        return model.facts

    if hf.is_hf_model(model):
        return hf.model_facts(model)

    return fx.module_facts(model)


def traced_program(model: torch.nn.Module | Program) -> Program:
    """The target's Program: traced unless given as one."""
    return model if isinstance(model, Program) else trace(model)
