"""``experts_over_replicas``: routed experts partitioned over every rank of ``D`` data-parallel
replicas (DP attention + EP, ``data_parallel_size=D`` with ``enable_expert_parallel``).

The EP group is all ``D·tp`` ranks; rank ``e = d·tp + t`` (replica ``d``, TP rank ``t``) holds
experts ``[e·E/(D·tp), (e+1)·E/(D·tp))``. Replica ``d`` has its own tokens, ``n_d`` of them, the
same on its ``tp`` ranks. Every ``ep_dispatch_experts`` module of the plan becomes:

1. **dispatch (all-gather)**: each input of the module that carries tokens (hidden states, the
   routed expert ids, their weights: everything whose dim 0 is the token count) is padded with
   zero rows to ``C`` rows and all-gathered over the EP group, giving ``[D·tp·C, ...]``;
   ``C`` is the length of the ``ep_rows`` input, which the runtime sets to ``max_d n_d``
   (a padded row has hidden state 0 and routing weight 0, so it contributes exactly 0);
2. every rank runs the module on the gathered rows with the experts it does not hold zeroed
   (the gathered weights of a foreign expert are masked to 0, so gate/up, the GLU and down give
   exact zeros: :func:`~.tp_modules.mask_foreign_experts`);
3. **combine (reduce-scatter)**: the module's ``[D·tp·C, H]`` partial output is summed over the
   EP group and rank ``e`` keeps block ``e`` (its own tokens, padded), then its first ``n_d`` rows.

Each (token, expert) pair is evaluated on exactly one rank, so every row of the result is the
unpartitioned module's output for that token up to adding zeros; routing per token does not
depend on the batch, so replica ``d``'s tokens get what a one-replica run gives them. The plan's
``ep_dispatch_experts`` entries are taken out of the TP plan (``shard_tp`` leaves the module
alone: no TP all-reduce at its output); shared experts and dense MLPs stay TP inside the replica.

Each rank's expert weights are the slice :class:`ReplicaExpertShard` names; the program is
compiled per replica (``replica=d``) because that slice depends on ``d``; the graph is the same
for every replica.
"""

from __future__ import annotations

import operator
from dataclasses import replace

import torch
import torch.fx

from ..errors import ConfigError, UnsupportedModelError
from ..mesh import Mesh
from ..program import META, PARAM, RANK, InputSpec, ReplicaExpertShard
from . import collectives as coll
from .graph_edit import Emitter, add_placeholders
from .manager import not_yet_run, program_pass, ran
from .tp_modules import mask_foreign_experts, module_paths
from .tp_styles import EXPERT_PARALLEL, plan_rule

aten = torch.ops.aten
DISPATCH_STYLE = "ep_dispatch_experts"


def valid_replica_counts(num_experts: int, tp: int, limit: int = 16) -> list[int]:
    """Data-parallel sizes ``D`` (up to ``limit``) whose ``D·tp`` ranks split ``num_experts``."""
    return [d for d in range(1, limit + 1) if num_experts % (d * tp) == 0]


def check_experts_divide(num_experts: int, tp: int, replicas: int) -> None:
    """``ConfigError`` unless ``replicas·tp`` divides ``num_experts``, naming the valid sizes."""
    if num_experts % (replicas * tp):
        raise ConfigError(
            f"data_parallel_size={replicas} with enable_expert_parallel at tensor_parallel_size={tp}: "
            f"{num_experts} routed experts cannot be partitioned over {replicas * tp} ranks; valid "
            f"data_parallel_size: {valid_replica_counts(num_experts, tp)}"
        )


def _module_nodes(graph: torch.fx.Graph, plan: dict[str, str]) -> dict[str, list[torch.fx.Node]]:
    found: dict[str, list[torch.fx.Node]] = {}
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        for path in module_paths(node):
            if plan_rule(plan, path) == DISPATCH_STYLE:
                found.setdefault(path, []).append(node)
                break
    return found


def _token_dim(node: torch.fx.Node):
    val = node.meta.get("val")
    return val.shape[0] if isinstance(val, torch.Tensor) and val.dim() > 0 else None


class ReplicaDispatch:
    """The dispatch/combine rewrite of one graph: ``ep`` EP ranks, this rank's EP index
    ``ep_rank`` and the ``ep_rows`` input (its length ``C``) are graph nodes."""

    def __init__(self, graph: torch.fx.Graph, ep: int, ep_rank: torch.fx.Node, rows: torch.fx.Node):
        self.graph, self.e, self.ep, self.ep_rank, self.rows = graph, Emitter(graph), ep, ep_rank, rows

    def gather(self, x: torch.fx.Node, before: torch.fx.Node) -> torch.fx.Node:
        """``x`` padded with zero rows to ``C = len(ep_rows)`` rows, all-gathered over EP
        (inserted before ``before``, the module's first call)."""
        e = self.e
        rank = x.meta["val"].dim()
        with self.graph.inserting_before(before):
            count = e(aten.sym_size.int, x, 0)
            capacity = e(aten.sym_size.int, self.rows, 0)
            e(aten._assert_scalar.default, e(operator.ge, capacity, count),
              "ep_rows is shorter than this replica's tokens: it must be the largest replica's count")
            missing = e(operator.sub, capacity, count)
            padded = e(aten.constant_pad_nd.default, x, [0, 0] * (rank - 1) + [0, missing], 0.0)
            return coll.all_gather(self.graph, padded, self.ep, "ep")

    def module(self, path: str, nodes: list[torch.fx.Node], is_param) -> int:
        """Rewrite the experts module at ``path`` (its call nodes ``nodes``): token inputs
        gathered, output reduce-scattered and cut to this replica's rows. ``is_param(node)``:
        whether an input from outside is a parameter (left alone). Returns how many there are."""
        members = set(nodes)
        # graph order, not set order: every rank must emit the same code (the programs' fingerprints
        # are compared across processes, and a set of nodes iterates by address)
        outside = list(dict.fromkeys(a for n in nodes for a in n.all_input_nodes if a not in members))
        params = {a for a in outside if is_param(a)}
        tokens = [a for a in outside if a not in params and isinstance(a.meta.get("val"), torch.Tensor)]
        sizes = [a for a in outside if a not in params and not isinstance(a.meta.get("val"), torch.Tensor)]
        if not tokens:
            raise UnsupportedModelError(f"{path}: the experts module takes no token inputs")
        count = _token_dim(tokens[0])
        if any(str(_token_dim(a)) != str(count) for a in tokens):
            shapes = {a.name: tuple(a.meta['val'].shape) for a in tokens}
            raise UnsupportedModelError(f"{path}: the experts' inputs disagree on the token count: {shapes}")
        if any(str(a.meta.get("val")) != str(count) for a in sizes):
            raise UnsupportedModelError(
                f"{path}: the experts module reads sizes from outside other than the token count "
                f"({[a.name for a in sizes]}); dispatching its tokens would leave them stale")
        gathered = {a: self.gather(a, nodes[0]) for a in tokens}
        first = gathered[tokens[0]]
        with self.graph.inserting_before(nodes[0]):
            rows = self.e(aten.sym_size.int, first, 0)
        for node in nodes:
            node.args = torch.fx.node.map_arg(node.args, lambda a: gathered.get(a, rows if a in sizes else a))
            node.kwargs = torch.fx.node.map_arg(node.kwargs, lambda a: gathered.get(a, rows if a in sizes else a))
        outputs = [n for n in nodes if any(u not in members for u in n.users)]
        if len(outputs) != 1:
            raise UnsupportedModelError(f"{path} has {len(outputs)} outputs in the traced graph; its combine "
                                        "needs exactly one")
        (out,) = outputs
        users = [u for u in out.users if u not in members]
        with self.graph.inserting_before(out.next):
            combined = coll.reduce_scatter(self.graph, out, self.ep, "ep")
            count_node = self.e(aten.sym_size.int, tokens[0], 0)
            mine = self.e(aten.slice.Tensor, combined, 0, 0, count_node)
        for user in users:
            user.replace_input_with(out, mine)
        return len(params)


@program_pass(
    "experts_over_replicas",
    requires=[ran("expert_parallel", "the plan must name the routed experts' ep_dispatch_experts modules"),
              not_yet_run("shard_tp", "shard_tp must not all-reduce the experts' output over TP")],
)
def experts_over_replicas(program, mesh: Mesh, replicas: int, replica: int):
    if replicas < 2 or not 0 <= replica < replicas:
        raise ConfigError(f"experts_over_replicas needs replicas >= 2 and 0 <= replica < replicas, got "
                          f"replicas={replicas}, replica={replica}")
    ep = replicas * mesh.tp
    plan = dict(program.facts.tp_plan)
    gm = program.copy_graph()
    graph = gm.graph
    modules = _module_nodes(graph, plan)
    if not modules:
        raise UnsupportedModelError(f"{program.facts.architecture}: no {DISPATCH_STYLE} module in the traced "
                                    "graph to partition over the replicas")
    specs = {s.name: s for s in program.inputs}
    expert_params = {s.name: s for s in program.inputs if s.kind == PARAM
                     and plan_rule({k: v for k, v in plan.items() if v in EXPERT_PARALLEL}, s.target)}
    ep_rank, rows = add_placeholders(graph, ["ep_rank", "ep_rows"])
    rewrite = ReplicaDispatch(graph, ep, ep_rank, rows)
    inside: set[torch.fx.Node] = {n for nodes in modules.values() for n in nodes}
    for path, nodes in modules.items():
        rewrite.module(path, nodes, lambda a: a.op == "placeholder" and a.name in specs)
    rules = {}
    for node in graph.nodes:
        if node.op != "placeholder" or node.name not in expert_params:
            continue
        spec = expert_params[node.name]
        full = program.state[spec.target]
        if full.shape[0] % ep:
            raise ConfigError(f"{spec.target}: {full.shape[0]} experts cannot be partitioned over the "
                              f"{ep} ranks of {replicas} replicas at tp={mesh.tp}; valid data_parallel_size: "
                              f"{valid_replica_counts(full.shape[0], mesh.tp)}")
        mask_foreign_experts(graph, Emitter(graph), node, spec.target, full, ep, lambda: ep_rank, inside)
        rules[node.name] = ReplicaExpertShard(0, ep, replicas=replicas, replica=replica)
    inputs = tuple(replace(s, shard=rules[s.name]) if s.name in rules else s for s in program.inputs)
    inputs += (InputSpec("ep_rank", RANK, "ep_rank"), InputSpec("ep_rows", META, "ep_rows"))
    tp_plan = {k: v for k, v in plan.items() if v not in EXPERT_PARALLEL and v != DISPATCH_STYLE}
    gm.recompile()
    result = program.replace(graph_module=gm, inputs=inputs, facts=replace(program.facts, tp_plan=tp_plan),
                             lowering=program.lowering.decided(expert_ranks=ep, replica=replica))
    return result, (f"{len(modules)} experts modules over {ep} EP ranks ({replicas} replicas x tp={mesh.tp}), "
                    f"replica {replica}: {len(rules)} expert parameters partitioned")
