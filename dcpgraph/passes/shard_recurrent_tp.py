"""``shard_recurrent_tp``: recurrent layers' heads/channels split over the TP group, per kind.

Runs after ``shard_tp`` (which leaves every recurrent layer's parameters alone, see
:func:`recurrent_parameter_targets`) and ``insert_recurrent_state`` (whose pools it resizes). Each
recurrent kind has one row in :data:`TP_RULES` (in :mod:`.recurrent_tp_rules`): the parameter suffix that names the layer's
module (its conv weight), the layer's indivisible unit count, every parameter's
:class:`~dcpgraph.program.ShardRule` by suffix, the ``[q | k | v]`` section sizes the traced
graph splits by (rescaled to ``1/tp``), and its pools' local shapes. For a layer the TP group
splits (``tp`` divides its units), rank ``r`` holds its ``1/tp`` of the heads/channels, the
output projection becomes row-parallel (``y = all_reduce(x_r W_rᵀ) + b``, the bias added once
after the sum) and its state pools hold ``1/tp`` of the state. A layer ``tp`` does not divide is
replicated: full weights and state on every rank, complete output, no collective (as
:meth:`~dcpgraph.recurrent_state.GatedDeltaNetShape.on_rank` counts it).

The traced recurrent layers use ``-1`` for every head count (:mod:`dcpgraph.ops.gated_delta_layer`,
:mod:`dcpgraph.frontends.gated_delta_net`, :mod:`dcpgraph.frontends.short_conv`,
:mod:`dcpgraph.ops.mamba2_layer`), so the only
literals that depend on the split are the section sizes rescaled here; shape propagation after
the pass checks the result.
"""

from __future__ import annotations

import torch
import torch.fx

from ..errors import UnsupportedModelError, VerificationError
from ..program import BUFFER, PARAM, InputSpec, Program, RecurrentStateSpec, ShardRule
from . import collectives as coll
from .graph_edit import Emitter, nodes_calling
from .manager import program_pass, ran
from .recurrent_tp_rules import (
    CONV_ARGS_POOL,
    LIGHTNING_ARGS_POOL,
    RULE_ARGS_POOL,
    SCAN_ARGS_POOL,
    TP_RULES,
    RecurrentLayer,
    RecurrentTPRule,
    aten,
    dcp_ops,
)


def _param_source(node: torch.fx.Node, specs: dict[str, InputSpec]) -> InputSpec | None:
    """The parameter (or buffer) a weight argument is read from through view-like ops (``squeeze``, ``view``…)."""
    while isinstance(node, torch.fx.Node) and node.op == "call_function" and node.all_input_nodes:
        node = node.args[0]
    if not isinstance(node, torch.fx.Node):
        return None
    spec = specs.get(node.name)
    return spec if spec is not None and spec.kind in (PARAM, BUFFER) else None


def recurrent_layers_of(program: Program) -> list[RecurrentLayer]:
    """The traced recurrent layers with their nodes and parameters, found from the state pools
    ``insert_recurrent_state`` made (``conv_state_<layer>``, ``recurrent_state_<layer>``,
    ``ssm_state_<layer>``, ``kv_state_<layer>``)."""
    graph = program.graph_module.graph
    specs = {s.name: s for s in program.inputs}
    kinds = dict(program.facts.extra.get("recurrent_layers") or {})
    convs = {n.args[CONV_ARGS_POOL].name: n for n in nodes_calling(graph, dcp_ops.causal_conv1d_.default)}
    rules = {n.args[RULE_ARGS_POOL].name: n for op in (dcp_ops.gated_delta_rule_.default, dcp_ops.kimi_delta_rule_.default)
             for n in nodes_calling(graph, op)}
    rules.update((n.args[SCAN_ARGS_POOL].name, n) for n in nodes_calling(graph, dcp_ops.mamba2_scan_.default))
    rules.update((n.args[LIGHTNING_ARGS_POOL].name, n)
                 for n in nodes_calling(graph, dcp_ops.lightning_attention_.default))
    layers = []
    for index, kind in sorted(kinds.items()):
        if kind not in TP_RULES:
            raise UnsupportedModelError(f"recurrent layer {index} ({kind}) has no TP rule; kinds with one: "
                                        f"{sorted(TP_RULES)}")
        rule = TP_RULES[kind]
        conv = convs.get(f"conv_state_{index}")
        anchor = conv if rule.anchor_pool == "conv_state" else rules.get(f"{rule.anchor_pool}_{index}")
        weight = _param_source(anchor.args[rule.anchor[2]], specs) if anchor is not None else None
        suffix = rule.conv_weight
        if weight is None or not weight.target.endswith(suffix):
            raise VerificationError(f"recurrent layer {index} ({kind}): no stateful {rule.anchor[0]} reading a "
                                    f"'{suffix}' parameter")
        prefix = weight.target.removesuffix(suffix)
        params = {s.target.removeprefix(prefix): s for s in program.inputs
                  if s.target.startswith(prefix) and (s.kind == PARAM or (
                      s.kind == BUFFER and s.target.removeprefix(prefix) in TP_RULES[kind].buffers))}
        state_space = (rules.get(f"recurrent_state_{index}") or rules.get(f"ssm_state_{index}")
                       or rules.get(f"kv_state_{index}"))
        layers.append(RecurrentLayer(index, kind, prefix, params, conv, state_space))
    return layers


def recurrent_parameter_targets(program: Program) -> set[str]:
    """Parameter targets under a recurrent layer's module, found from the traced canonical ops or
    their stateful forms: ``shard_tp`` leaves these to this pass."""
    specs = {s.name: s for s in program.inputs}
    graph = program.graph_module.graph
    anchors = [(node, arg) for stateful, canonical, arg in {r.anchor for r in TP_RULES.values()}
               for node in (*nodes_calling(graph, canonical), *nodes_calling(graph, stateful))]
    suffixes = {r.conv_weight for r in TP_RULES.values()}
    prefixes = set()
    for node, arg in anchors:
        weight = _param_source(node.args[arg], specs)
        suffix = next((x for x in suffixes if weight is not None and weight.target.endswith(x)), None)
        if suffix is not None:
            prefixes.add(weight.target.removesuffix(suffix))
    return {s.target for s in program.inputs if s.kind == PARAM and any(s.target.startswith(p) for p in prefixes)}


def _row_parallel(graph: torch.fx.Graph, linear: torch.fx.Node) -> None:
    """``linear(x_r, W_r, b)`` → ``all_reduce(linear(x_r, W_r)) + b``."""
    bias = linear.args[2] if len(linear.args) > 2 else None
    linear.args = linear.args[:2]
    with graph.inserting_before(linear.next):
        reduced = coll.all_reduce(graph, linear, "tp")
        result = Emitter(graph)(aten.add.Tensor, reduced, bias) if bias is not None else reduced
    linear.replace_all_uses_with(result)
    reduced.args[0].args = (linear, *reduced.args[0].args[1:])


def _split_layer(graph: torch.fx.Graph, layer: RecurrentLayer, rule: RecurrentTPRule, shape,
                 tp: int) -> dict[str, ShardRule]:
    """Rewrite one layer for a split over ``tp``; returns its parameters' rules by input name."""
    wanted = rule.param_rules(shape)
    unknown = sorted(set(layer.params) - set(wanted))
    if unknown:
        raise UnsupportedModelError(f"recurrent layer {layer.index} ({layer.kind}): parameters {unknown} under "
                                    f"{layer.prefix} have no TP rule; known: {sorted(wanted)}")
    sections = rule.sections(shape)
    if sections is not None:
        specs = {s.name: s for s in layer.params.values()}
        wanted_sizes = [list(sections), *(list(parts) for parts in rule.weight_splits(shape))]
        splits = [n for n in nodes_calling(graph, aten.split_with_sizes.default)
                  if (n.args[0] is layer.conv or _param_source(n.args[0], specs) is not None)
                  and list(n.args[1]) in wanted_sizes]
        for split in splits:
            split.args = (split.args[0], [size // tp for size in split.args[1]], *split.args[2:])
        if not any(n.args[0] is layer.conv for n in splits):
            raise VerificationError(f"recurrent layer {layer.index}: no split of the conv output into sections "
                                    f"{list(sections)}")
    out_weight = next((layer.params[f"{name}.weight"] for name in rule.out_proj
                       if f"{name}.weight" in layer.params), None)
    linears = [n for n in nodes_calling(graph, aten.linear.default)
               if out_weight is not None and n.args[1].name == out_weight.name]
    if len(linears) != 1:
        raise VerificationError(f"recurrent layer {layer.index}: expected one {'/'.join(rule.out_proj)} linear, found {len(linears)}")
    _row_parallel(graph, linears[0])
    if rule.rewrite is not None:
        rule.rewrite(graph, layer, tp)
    return {spec.name: wanted[suffix] for suffix, spec in layer.params.items()}


def _pools_fit_their_ops(program: Program) -> None:
    """Every state pool's per-slot shape is what its op reads on this rank: a conv state
    ``[C_r, K−1]`` for the conv's local weight ``[C_r, K]``, a delta-rule state ``[Hv_r, Dk, Dv]``
    for its local ``k [T, Hk_r, Dk]`` and ``v [T, Hv_r, Dv]``, a Mamba-2 SSM state ``[Hh_r, P, N]``
    for its scan's local ``x [T, Hh_r, P]`` and ``B [T, G_r, N]``, a lightning kv state
    ``[H_r, D, Dv]`` for its local ``q [T, H_r, D]`` and ``v [T, H_r, Dv]``."""
    pools = {p.name: tuple(p.shape) for p in program.recurrent_states}
    graph = program.graph_module.graph
    for op, pool_arg, what, per_slot in _POOL_READERS:
        for node in nodes_calling(graph, op):
            pool, want = node.args[pool_arg].name, per_slot(*(a.meta["val"] if isinstance(a, torch.fx.Node) else a
                                                                for a in node.args))
            if pools.get(pool) != want:
                raise VerificationError(f"{pool} holds {pools.get(pool)} per slot, its {what} reads {want}")


def _conv_slot(x, weight, *_) -> tuple[int, ...]:
    return int(weight.shape[0]), int(weight.shape[1]) - 1


def _delta_rule_slot(q, k, v, *_) -> tuple[int, ...]:
    return int(v.shape[1]), int(k.shape[2]), int(v.shape[2])


def _scan_slot(x, dt, a, b, *_) -> tuple[int, ...]:
    return int(x.shape[1]), int(x.shape[2]), int(b.shape[2])


def _lightning_slot(q, k, v, *_) -> tuple[int, ...]:
    return int(q.shape[1]), int(q.shape[2]), int(v.shape[2])


# (stateful op, its pool's argument index, what it is, the per-slot state shape its inputs read)
_POOL_READERS = (
    (dcp_ops.causal_conv1d_.default, CONV_ARGS_POOL, "conv", _conv_slot),
    (dcp_ops.gated_delta_rule_.default, RULE_ARGS_POOL, "delta rule", _delta_rule_slot),
    (dcp_ops.kimi_delta_rule_.default, RULE_ARGS_POOL, "Kimi delta rule", _delta_rule_slot),
    (dcp_ops.mamba2_scan_.default, SCAN_ARGS_POOL, "Mamba-2 scan", _scan_slot),
    (dcp_ops.lightning_attention_.default, LIGHTNING_ARGS_POOL, "lightning attention", _lightning_slot),
)


@program_pass("shard_recurrent_tp", requires=[
    ran("shard_tp", "the mesh's TP size is set, and shard_tp leaves the recurrent layers to this pass"),
    ran("insert_recurrent_state", "its state pools are resized to the rank's heads/channels"),
], ensures=[_pools_fit_their_ops])
def shard_recurrent_tp(program: Program):
    tp = program.mesh.tp
    if tp == 1:
        return program, "tp=1: nothing to shard"
    gm = program.copy_graph()
    graph = gm.graph
    rules: dict[str, ShardRule] = {}
    pool_shapes: dict[str, tuple[int, ...]] = {}
    split, replicated = [], []
    for layer in recurrent_layers_of(program.replace(graph_module=gm)):
        rule = TP_RULES[layer.kind]
        shape = rule.shape(layer, program)
        if rule.units(shape) % tp:
            replicated.append(layer.index)
            continue
        rules.update(_split_layer(graph, layer, rule, shape, tp))
        for role, local in rule.pools(shape.on_rank(tp)).items():
            pool_shapes[f"{role}_{layer.index}"] = tuple(local)
        split.append(layer.index)
    gm.recompile()
    inputs = tuple(InputSpec(s.name, s.kind, s.target, rules.get(s.name, s.shard)) for s in program.inputs)
    pools = tuple(RecurrentStateSpec(p.name, p.layer, p.role, pool_shapes.get(p.name, p.shape), p.dtype)
                  for p in program.recurrent_states)
    result = program.replace(graph_module=gm, inputs=inputs, recurrent_states=pools)
    return result, (f"tp={tp}: recurrent layers {split} split by heads/channels (row-parallel output, state 1/{tp})"
                    + (f"; layers {replicated} replicated (tp does not divide their heads/channels)"
                       if replicated else ""))
