"""``shard_tp``'s rewrites that are not one linear at a time: parameter entries, module-output
reductions, expert parallelism, and merging two all-reduces that meet in a sum.

**Grouped experts, tensor-parallel** (``packed_colwise`` gate/up, ``rowwise`` down, module
``moe_tp_experts``): every rank runs its ``1/tp`` slice of every expert's intermediate features for
every routed token; the down projections' partial sums are all-reduced once at the experts'
output. Routing (the gate linear, top-k) is replicated, so every rank routes identically.

**Expert parallelism** (``grouped_gemm`` parameters, module ``ep_dispatch_experts``; what
``enable_expert_parallel=True`` selects): rank ``r`` holds experts ``[r·E/tp, (r+1)·E/tp)``. In a
TP group every rank already holds every token (activations are replicated), so dispatching a
token to the rank owning its expert and combining by all-to-all is, value for value, this: each
rank evaluates the (token, expert) pairs whose expert it owns, writes exact zeros for the others
(their gathered expert weights are zeroed, so gate/up, the GLU and down give 0), and the combine is
the sum over ranks, i.e. the same all-reduce as the TP path. Each pair is evaluated on exactly one
rank, so the sum equals the unsharded result up to adding zeros.

**One all-reduce for the MoE block**: where a sum adds two TP all-reduces (routed experts +
shared experts), ``allreduce(a) + allreduce(b)`` becomes ``allreduce(a + b)`` (views between a
reduce and the sum are moved with it: all-reduce is elementwise).
"""

from __future__ import annotations

import torch
import torch.fx

from ..errors import UnsupportedModelError
from ..program import PARAM
from . import collectives as coll
from .graph_edit import Emitter
from .tp_styles import (
    COLWISE,
    EXPERT_PARALLEL,
    GATHER_OUTPUT,
    MODULE_REDUCE,
    ROWWISE,
    SPLIT_INPUT,
    param_rule,
    plan_rule,
)

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
_VIEWS = frozenset({aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.squeeze.dim,
                    aten.unsqueeze.default})


def _match(plan: dict[str, str], path: str, styles) -> str | None:
    sub = {k: v for k, v in plan.items() if v in styles}
    return plan_rule(sub, path) if sub else None


def module_paths(node: torch.fx.Node) -> list[str]:
    """The node's enclosing module paths, outermost first, without the trace wrapper's component
    (HF models are traced inside a wrapper whose attribute is ``model``)."""
    stack = node.meta.get("nn_module_stack") or {}
    paths = []
    for value in stack.values():
        path = value[0] if isinstance(value, tuple) else str(value)
        paths.append(path.split(".", 1)[1] if path.startswith("model.") else path)
    return paths


def reduce_module_outputs(graph: torch.fx.Graph, plan: dict[str, str], count, tp: int) -> set[torch.fx.Node]:
    """All-reduce the single output of every module whose style is in ``MODULE_REDUCE``; returns
    the nodes inside reduced modules."""
    groups: dict[str, list[torch.fx.Node]] = {}
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        for path in module_paths(node):
            if _match(plan, path, MODULE_REDUCE):
                groups.setdefault(path, []).append(node)
                break
    inside: set[torch.fx.Node] = set()
    for path, nodes in groups.items():
        members = set(nodes)
        outputs = [n for n in nodes if any(u not in members for u in n.users)]
        if len(outputs) != 1:
            raise UnsupportedModelError(
                f"module {path} ({_match(plan, path, MODULE_REDUCE)}) has {len(outputs)} outputs in the "
                "traced graph; its all-reduce needs exactly one"
            )
        (out,) = outputs
        with graph.inserting_before(out.next):
            reduced = coll.all_reduce(graph, out, "tp")
        out.replace_all_uses_with(reduced)
        reduced.args[0].args = (out, *reduced.args[0].args[1:])
        inside |= members
        count(_match(plan, path, MODULE_REDUCE))
    return inside


def shard_parameters(program, graph, plan, specs, rules, assign, count, tp: int, tp_rank, reduced) -> None:
    """Plan entries that name a parameter (grouped experts, attention sinks)."""
    e = Emitter(graph)
    placeholders = {n.name: n for n in graph.nodes if n.op == "placeholder"}
    for spec in program.inputs:
        if spec.kind != PARAM or spec.name in rules or spec.name not in placeholders:
            continue
        style = _match(plan, spec.target, COLWISE | ROWWISE | EXPERT_PARALLEL)
        if style is None:
            continue
        node = placeholders[spec.name]
        full = program.state[spec.target]
        is_bias = spec.target.endswith("bias")
        if style in GATHER_OUTPUT or style in SPLIT_INPUT:
            raise UnsupportedModelError(f"{spec.target}: style {style!r} needs a linear, found a bare parameter")
        if style in EXPERT_PARALLEL:
            mask_foreign_experts(graph, e, node, spec.target, full, tp, tp_rank, reduced)
        elif style in ROWWISE:
            if is_bias:
                raise UnsupportedModelError(
                    f"{spec.target}: a bias of a row-parallel grouped expert would be summed {tp} times"
                )
            if not node.users or any(u not in reduced for u in node.users):
                raise UnsupportedModelError(
                    f"{spec.target} ({style}) leaves partial sums but is not inside a module whose output "
                    f"is all-reduced (moe_tp_experts / all_reduce)"
                )
        assign(node, param_rule(style, full.dim(), is_bias), spec.target)
        count(style)


def mask_foreign_experts(graph, e: Emitter, node, target: str, full: torch.Tensor, tp: int, tp_rank, reduced) -> None:
    """Every per-token gather of expert parameter ``node`` (``full``: ``E`` experts) reads the
    rank's ``E/tp`` local experts: ids outside ``[tp_rank()·E/tp, (tp_rank()+1)·E/tp)`` read local
    expert 0 and the gathered rows are zeroed, so they contribute exact zeros. ``tp`` and
    ``tp_rank`` are the group the experts are partitioned over (the TP group, or the EP group of
    data-parallel replicas); the gathers must sit in ``reduced`` (the dispatching module)."""
    experts = full.shape[0]
    if experts % tp:
        raise UnsupportedModelError(f"{target}: {experts} experts cannot be partitioned over {tp} ranks")
    local_experts = experts // tp
    for user in list(node.users):
        ok = (user.target is aten.index.Tensor and user.args[0] is node and len(user.args[1]) == 1
              and user.args[1][0] is not None and user in reduced)
        ids = user.args[1][0] if ok else None
        val = ids.meta.get("val") if ids is not None else None
        if not ok or val is None or val.dim() != 1:
            raise UnsupportedModelError(
                f"{target}: expert parallelism needs the experts gathered per token by expert id "
                f"(HF's batched_mm experts inside an ep_dispatch_experts module); found {user.format_node()}"
            )
        with graph.inserting_before(user):
            local = e(aten.sub.Tensor, ids, e(aten.mul.Tensor, tp_rank(), local_experts))
            outside = e(aten.logical_or.default, e(aten.lt.Scalar, local, 0), e(aten.ge.Scalar, local, local_experts))
            safe = e(aten.masked_fill.Scalar, local, outside, 0)
            mask = e(aten.reshape.default, outside, [-1] + [1] * (full.dim() - 1))
        with graph.inserting_before(user.next):
            zeroed = e(aten.masked_fill.Scalar, user, mask, 0.0)
        user.replace_all_uses_with(zeroed)
        zeroed.args = (user, *zeroed.args[1:])
        user.args = (node, [safe])


def _reduced_source(node: torch.fx.Node) -> tuple[list[torch.fx.Node], torch.fx.Node] | None:
    """Walking up single-user views from ``node``: ``(views, wait)`` if they end at a TP
    all-reduce's wait used only by this chain."""
    views = []
    while node.op == "call_function" and node.target in _VIEWS and len(node.users) == 1:
        views.append(node)
        node = node.args[0]
    if node.op != "call_function" or node.target is not c10d.wait_tensor.default or len(node.users) != 1:
        return None
    reduce = node.args[0]
    group = coll.collective_group(reduce)
    if reduce.target is not c10d.all_reduce.default or group is None or group[0] != "tp" or reduce.args[1] != "sum":
        return None
    return views, node


def merge_summed_reductions(graph: torch.fx.Graph) -> int:
    """``allreduce(a) + allreduce(b)`` → ``allreduce(a + b)``; returns how many sums were merged."""
    merged = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.add.Tensor or node.kwargs or len(node.args) != 2:
            continue
        a, b = node.args
        if not (isinstance(a, torch.fx.Node) and isinstance(b, torch.fx.Node)):
            continue
        found = [_reduced_source(a), _reduced_source(b)]
        if None in found or found[0][1] is found[1][1]:
            continue
        for _, wait in found:
            reduce = wait.args[0]
            wait.replace_all_uses_with(reduce.args[0])
            graph.erase_node(wait)
            graph.erase_node(reduce)
        with graph.inserting_before(node.next):
            reduced = coll.all_reduce(graph, node, "tp")
        node.replace_all_uses_with(reduced)
        reduced.args[0].args = (node, *reduced.args[0].args[1:])
        merged += 1
    return merged
