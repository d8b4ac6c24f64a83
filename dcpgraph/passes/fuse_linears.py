"""``fuse_linears``: sibling linears (one input, several weights) → one linear and its slices.

Linears ``y_i = aten.linear(x, W_i, b_i?)`` that read the same node ``x`` (q/k/v; gate/up; an MLA
model's ``q_a``/``kv_a``; a router next to a shared expert) become::

    y = aten.linear(x, W, b?);   (y_1, …, y_k) = split_with_sizes(y, [n_1, …, n_k], -1)

with ``W = cat(W_i)`` along dim 0 (``b = cat(b_i)``) and ``n_i`` the rows of rank's ``W_i``, so
one GEMM (one parallel region, one read of ``x``) does what ``k`` did; each output is the same
sum of the same products as before (a GEMM over a wider weight may block the sum differently:
fp rounding only, as a TP all-reduce already does). The
pieces are views (one op, no copy): strided along the rows when the step has more than one, which
every consumer of a projection (views into heads, norms, rotary, the cache write) reads as is.

Siblings fuse only when they all agree: every ``W_i`` a 2-D parameter of one dtype and device and
the same input width, every ``b_i`` a 1-D parameter of that dtype, or none of them with one; and
every shard rule ``shard_tp`` gave ``W_i`` (and ``b_i``) replicates or splits its output rows
(:func:`~dcpgraph.program.section_ranges`: colwise, by heads, packed). Linears by other ops
(quantized, native, already lowered) are never touched.

The fused weight is a state entry the program declares (:class:`~dcpgraph.program.StateSource`
``"concat_rows"`` of the siblings' entries) sharded by :class:`~dcpgraph.program.RowSections`:
rank ``r`` holds the concatenation of the siblings' rank-``r`` shards, cut from the full
concatenation at load (from a checkpoint: only those rows are read). The siblings' own
placeholders leave the program when nothing else reads them.

It runs after ``shard_tp`` (the shard rules it composes) and ``fuse_mla_preprocess`` (whose
patterns match MLA's projections as separate linears), before ``native_linear``, which then
lowers the fused linear like any other.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from ..program import PARAM, InputSpec, Program, RowSections, StateSource, section_ranges
from .manager import not_yet_run, program_pass, ran

aten = torch.ops.aten


def _param(node, specs: dict[str, InputSpec], ndim: int):
    """``(spec, value)`` of ``node`` if it is an ``ndim``-D parameter placeholder whose shard
    rule splits (or replicates) dim 0, else None."""
    if not (isinstance(node, torch.fx.Node) and node.op == "placeholder"):
        return None
    spec = specs.get(node.name)
    val = node.meta.get("val")
    if spec is None or spec.kind != PARAM or not isinstance(val, torch.Tensor) or val.dim() != ndim:
        return None
    if spec.shard.dim is not None and spec.shard.dim % ndim != 0:
        return None
    return spec, val


def _key(node, specs: dict[str, InputSpec]):
    """What siblings must share to fuse (input width, dtype, device, has a bias), or None when
    ``node`` is not a linear this pass can fuse."""
    if not (node.op == "call_function" and node.target is aten.linear.default and not node.kwargs):
        return None
    weight = _param(node.args[1], specs, 2)
    bias = node.args[2] if len(node.args) > 2 else None
    if weight is None or (bias is not None and _param(bias, specs, 1) is None):
        return None
    w = weight[1]
    if bias is not None and bias.meta["val"].dtype != w.dtype:
        return None
    return (tuple(w.shape[1:]), w.dtype, w.device, bias is not None)


def sibling_groups(program: Program) -> list[list[torch.fx.Node]]:
    """Groups of ≥ 2 linears reading one input that all agree (:func:`_key`), in graph order
    (each group in graph order, groups by their first linear), so the same graph gives the same
    groups in every process. An input read by linears that disagree keeps them all apart."""
    specs = {s.name: s for s in program.inputs}
    by_input: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for node in program.graph_module.graph.nodes:
        if node.op == "call_function" and node.target is aten.linear.default:
            by_input.setdefault(node.args[0], []).append(node)
    groups = []
    for nodes in by_input.values():  # insertion order: graph order of each group's first linear
        keys = {_key(n, specs) for n in nodes}
        weights = [n.args[1] for n in nodes]
        if (len(nodes) >= 2 and len(keys) == 1 and None not in keys and len(set(weights)) == len(weights)
                and _splittable(nodes, specs, program)):
            groups.append(nodes)
    return groups


def _splittable(nodes: list[torch.fx.Node], specs: dict[str, InputSpec], program: Program) -> bool:
    """Every sibling's weight (and bias) rule gives each rank whole rows, the bias the same rows
    as its weight."""
    tp = program.mesh.tp
    for node in nodes:
        weight = specs[node.args[1].name]
        bias = specs[node.args[2].name] if len(node.args) > 2 and node.args[2] is not None else None
        rows = int(program.state[weight.target].shape[0])
        for rank in range(tp):
            ranges = section_ranges(weight.shard, rows, rank, tp)
            if ranges is None:
                return False
            if bias is not None and section_ranges(bias.shard, rows, rank, tp) != ranges:
                return False
    return True


def _fused_entry(program: Program, name: str, members: list[InputSpec], state: dict, sources: dict) -> InputSpec:
    """Declare the concatenation of ``members``' state entries as placeholder ``name``: its
    state value (the full tensors concatenated; meta where they are meta), its source and its
    row-section rule."""
    targets = [m.target for m in members]
    target = "cat(" + ", ".join(targets) + ")"
    fulls = [program.state[t] for t in targets]
    state[target] = torch.cat(fulls, 0)
    sources[target] = StateSource("concat_rows", tuple(targets))
    rule = RowSections(sections=tuple((int(f.shape[0]), m.shard) for f, m in zip(fulls, members)))
    return InputSpec(name, PARAM, target, rule)


@program_pass(
    "fuse_linears",
    requires=[
        ran("shard_tp", "the fused rule composes the siblings' TP shard rules"),
        ran("fuse_mla_preprocess", "its patterns match MLA's projections as separate linears"),
        not_yet_run("native_linear", "the fused linear must still be an aten.linear to be lowered"),
    ],
)
def fuse_linears(program: Program, enabled: bool = True):
    if not enabled:
        return program, "disabled"
    groups = sibling_groups(program)
    if not groups:
        return program, "no sibling linears"
    gm = program.copy_graph()
    graph = gm.graph
    nodes = {n.name: n for n in graph.nodes}
    specs = {s.name: s for s in program.inputs}
    state, sources = dict(program.state), dict(program.sources)
    added: dict[str, list[InputSpec]] = {}  # new entries, by the spec they go right before
    sizes, originals = [], set()
    for group in groups:
        linears = [nodes[n.name] for n in group]
        operands = [[ln.args[1] for ln in linears]]
        if len(linears[0].args) > 2 and linears[0].args[2] is not None:
            operands.append([ln.args[2] for ln in linears])
        fused_args = [linears[0].args[0]]
        for members in operands:
            with graph.inserting_before(members[0]):
                placeholder = graph.placeholder(f"fused_{members[0].name}")
            entry = _fused_entry(program, placeholder.name, [specs[m.name] for m in members], state, sources)
            added.setdefault(members[0].name, []).append(entry)
            originals.update(m.name for m in members)
            fused_args.append(placeholder)
        widths = [int(linear.meta["val"].shape[-1]) for linear in linears]
        with graph.inserting_before(linears[0]):
            fused = graph.call_function(aten.linear.default, tuple(fused_args))
            pieces = graph.call_function(aten.split_with_sizes.default, (fused, widths, -1))
            for index, linear in enumerate(linears):
                linear.replace_all_uses_with(graph.call_function(operator.getitem, (pieces, index)))
        for linear in linears:
            graph.erase_node(linear)
        sizes.append(len(linears))
    removed = set()
    for node in list(graph.nodes):
        if node.op == "placeholder" and node.name in originals and not node.users:
            graph.erase_node(node)
            removed.add(node.name)
    gm.recompile()
    inputs = []
    for spec in program.inputs:
        inputs.extend(added.get(spec.name, []))
        if spec.name not in removed:
            inputs.append(spec)
    counts = {k: sizes.count(k) for k in sorted(set(sizes))}
    summary = ", ".join(f"{c} groups of {k}" for k, c in counts.items())
    return (program.replace(graph_module=gm, inputs=tuple(inputs), state=state, sources=sources),
            f"{sum(sizes)} linears → {len(sizes)} ({summary})")
