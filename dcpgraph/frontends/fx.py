"""Front end for plain ``nn.Module`` language models.

Convention: ``model(input_ids, position_ids) -> logits`` with ``input_ids`` and ``position_ids``
both ``[1, T]`` int64 (one flattened token sequence with explicit positions, as in the HF front
end) and ``logits [1, T, V]``. A forward that takes only ``input_ids`` is accepted too (it is
wrapped), but then the model must not derive positions from the token count: a graph that ignores
``position_ids`` yet still builds an ``arange`` after canonicalization is refused, because during
decoding a step's tokens do not start at position 0.

:func:`trace_module` exports the module with ``torch.export`` (non-strict, dynamic token count,
range inferred by export) and runs ``canonicalize_attention``, which turns SDPA and hand-written
matmul–softmax–matmul attention into ``torch.ops.dcpgraph.attention`` nodes (see
:mod:`dcpgraph.frontends.canonicalize`). :func:`module_facts` reads the facts off that graph:

- ``num_layers``: the number of canonical attention nodes;
- ``num_q_heads`` / ``num_kv_heads`` / ``head_dim`` / ``v_head_dim``: from the q/k/v shapes (every
  layer must agree);
- ``vocab_size``: the logits' last dim; ``hidden_size``: the token embedding's width;
- ``attention="gqa"``, ``architecture`` = the class name;
- ``tp_plan``: the module's ``tp_plan`` attribute if it has one (module-path pattern → "colwise" /
  "rowwise" / "colwise_gather_output"), else empty; ``compile(..., plan=...)`` can pass one;
- ``extra["max_position_embeddings"]``: rows of an embedding indexed by ``position_ids``, else the
  module's ``max_position_embeddings`` attribute, else None.

The traced Program is cached per module (weakly), so ``compile`` traces once for facts and graph.
"""

from __future__ import annotations

import inspect
import weakref

import torch

from ..errors import UnsupportedModelError
from ..passes.verify import propagate_shapes
from ..program import PARAM, USER, ModelFacts, Program
from . import export as export_mod

_TP_RULES = frozenset({"colwise", "rowwise", "colwise_gather_output"})
_EXAMPLE_TOKENS = 8

_cache: weakref.WeakKeyDictionary[torch.nn.Module, Program] = weakref.WeakKeyDictionary()


class _IdsOnly(torch.nn.Module):
    """``(input_ids, position_ids) -> logits`` around a module whose forward takes only ids."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids)


def _takes_positions(model: torch.nn.Module) -> bool:
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return True
    positional = [
        p for p in params
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
    ]
    return len(positional) >= 2 or any(p.kind is p.VAR_POSITIONAL for p in positional)


def default_example_inputs(tokens: int = _EXAMPLE_TOKENS) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids ``0, 1, 0, 1…`` (valid for any vocabulary of 2+) and positions ``0..T-1``."""
    ids = (torch.arange(tokens) % 2).unsqueeze(0)
    return ids, torch.arange(tokens).unsqueeze(0)


def trace_module(model: torch.nn.Module, example_inputs=None) -> Program:
    """Export ``model`` and canonicalize its attention; cached per module for default inputs."""
    if example_inputs is None:
        cached = _cache.get(model)
        if cached is not None:
            return cached
    program = _trace(model, example_inputs)
    if example_inputs is None:
        _cache[model] = program
    return program


def module_facts(model: torch.nn.Module) -> ModelFacts:
    """Facts of a plain module, read from its traced graph (traced once, then cached)."""
    return trace_module(model).facts


def _trace(model: torch.nn.Module, example_inputs) -> Program:
    name = type(model).__name__
    if example_inputs is None:
        example_inputs = default_example_inputs()
    if _takes_positions(model):
        wrapper, prefix = model, ""
    else:
        wrapper, prefix = _IdsOnly(model), "model."
    dynamic = ({1: torch.export.Dim.DYNAMIC}, {1: torch.export.Dim.DYNAMIC})
    placeholder = ModelFacts(
        architecture=name, attention="gqa", num_layers=0, num_q_heads=0, num_kv_heads=0,
        head_dim=0, v_head_dim=0, vocab_size=0, hidden_size=0,
    )
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            exported, seconds = export_mod.run_export(wrapper, tuple(example_inputs), dynamic)
    finally:
        model.train(was_training)
    program = export_mod.program_from_export(exported, placeholder, prefix=prefix, seconds=seconds)
    program = export_mod.finish(program)
    _check_positions(program, name)
    return export_mod.with_facts(program, lambda p: _facts(p, model))


def _user_node(program: Program, role: str) -> torch.fx.Node | None:
    names = {s.name for s in program.inputs if s.kind == USER and s.target == role}
    return next((n for n in program.placeholders() if n.name in names), None)


def _check_positions(program: Program, name: str) -> None:
    positions = _user_node(program, "position_ids")
    if positions is not None and positions.users:
        return
    for node in program.graph_module.graph.nodes:
        if node.op == "call_function" and "arange" in str(node.target):
            raise UnsupportedModelError(
                f"{name}: the forward ignores position_ids but builds positions with {node.target} "
                f"(node {node.name}); take position_ids as the second argument, because a decode "
                "step's tokens do not start at position 0"
            )


def _facts(program: Program, model: torch.nn.Module) -> ModelFacts:
    name = type(model).__name__
    graph = program.graph_module.graph
    attention = [
        n for n in graph.nodes
        if n.op == "call_function" and n.target is torch.ops.dcpgraph.attention.default
    ]
    if not attention:
        raise UnsupportedModelError(f"{name}: no recognisable attention in the traced graph")
    if any("val" not in a.meta for n in attention for a in n.args[:3]):
        propagate_shapes(program)
    dims = set()
    for node in attention:
        q, k, v = (a.meta["val"].shape for a in node.args[:3])
        dims.add((int(q[1]), int(k[1]), int(q[-1]), int(v[-1])))
    if len(dims) != 1:
        raise UnsupportedModelError(
            f"{name}: attention layers differ in (q heads, kv heads, head dim, v head dim): "
            f"{sorted(dims)}; dcpgraph needs uniform layers"
        )
    ((heads, kv_heads, head_dim, v_head_dim),) = dims
    output = next(n for n in reversed(graph.nodes) if n.op == "output").args[0]
    outputs = list(output) if isinstance(output, (tuple, list)) else [output]
    logits = outputs[0].meta.get("val") if isinstance(outputs[0], torch.fx.Node) else None
    if len(outputs) != 1 or not isinstance(logits, torch.Tensor) or logits.dim() != 3:
        raise UnsupportedModelError(
            f"{name}: the forward must return only logits [1, T, vocab], got {len(outputs)} outputs"
        )
    specs = {s.name: s for s in program.inputs}
    ids, positions = _user_node(program, "input_ids"), _user_node(program, "position_ids")
    hidden, max_positions = 0, None
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not torch.ops.aten.embedding.default:
            continue
        weight = program.state.get(specs[node.args[0].name].target) if node.args[0].name in specs else None
        if weight is None:
            continue
        if node.args[1] is ids and not hidden:
            hidden = int(weight.shape[1])
        if node.args[1] is positions and max_positions is None:
            max_positions = int(weight.shape[0])
    if max_positions is None:
        max_positions = getattr(model, "max_position_embeddings", None)
    params = [program.state[s.target] for s in program.inputs if s.kind == PARAM]
    eos = getattr(model, "eos_token_id", None)
    eos_ids = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
    return ModelFacts(
        architecture=name,
        attention="gqa",
        num_layers=len(attention),
        num_q_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        v_head_dim=v_head_dim,
        vocab_size=int(logits.shape[-1]),
        hidden_size=hidden,
        dtype=params[0].dtype if params else torch.float32,
        eos_token_id=eos_ids,
        tp_plan=_tp_plan(model),
        extra={"max_position_embeddings": max_positions},
    )


def _tp_plan(model: torch.nn.Module) -> dict[str, str]:
    plan = getattr(model, "tp_plan", None)
    if not plan:
        return {}
    if not isinstance(plan, dict):
        raise UnsupportedModelError(f"{type(model).__name__}.tp_plan must be a dict, got {type(plan).__name__}")
    bad = {k: v for k, v in plan.items() if v not in _TP_RULES}
    if bad:
        raise UnsupportedModelError(f"{type(model).__name__}.tp_plan has unknown rules {bad}; use {sorted(_TP_RULES)}")
    return dict(plan)
