"""``comm="ag"``: DCP where each rank computes every query head of its DCP group itself.

Every rank of a DCP group (``N`` of the ``tp`` ranks) holds the query projection of the whole
group's heads, so per layer and rank::

    q          = q_proj(x)                            # the group's N·H heads: no query gather
    o_c, lse_c = paged_attention(q, local cache, local_context_lens)
    parts      = all_gather([o_c ‖ lse_c])            # [N, T, N·H, Dv+1] over the DCP group
    o, lse     = merge_attention(parts)               # exact, every head of the group, on every rank
    y          = o_proj(o)                            # dcp == tp: o_proj whole, y complete, no all-reduce
    y          = all_reduce(o_proj(o[my heads]))      # dcp < tp: o_proj keeps its TP shard

With ``dcp == tp`` that is one collective for the layer's attention instead of three (query
all-gather, merge exchange, the output projection's all-reduce); with ``dcp < tp``, two instead of
three. The KV cache is sharded by sequence exactly as for ``a2a``. The price is ``N`` times the
query projection's TP-sharded bytes (and the output projection's, at ``dcp == tp``) on every
rank, read once per step: worth it where collectives cost more than those bytes, as on a host link
(``benchmarks/decode_scaling.py``). The group's ranks compute the same values for its heads, so
the hidden state stays replicated as the rest of the TP graph expects.

The projections are found from each context attention: the query projection is the one linear
reached walking back from its query (stopping at linears), column-parallel; the output projection
is the one linear reached walking forward from its result, row-parallel, whose only user is a TP
all-reduce. Anything else (a fused QKV or packed projection, an all-reduce shared with another
branch, a sparse read, a head-sharded parameter such as sink logits feeding any node computed
from the query before the output projection) raises :class:`~dcpgraph.errors.UnsupportedModelError`
naming ``a2a`` and ``ag_rs``, which need neither. :func:`ag_rules` makes the same checks without
rewriting the graph (``comm="auto"`` offers ``ag`` only where they pass).
"""

from __future__ import annotations

import torch
import torch.fx

from ..collectives import ALL_REDUCE, WAIT, collective_of
from ..errors import UnsupportedModelError
from ..program import PARAM, REPLICATE, STATE_KINDS, InputSpec, ShardRule
from . import collectives as coll
from .graph_edit import context_reads

aten = torch.ops.aten
dcp_ops = torch.ops.dcpgraph
_ROWWISE, _COLWISE = ShardRule(1), ShardRule(0)


def _linears(start: torch.fx.Node, forward: bool) -> tuple[set[torch.fx.Node], set[torch.fx.Node]]:
    """``(linears, walked)``: the ``aten.linear`` nodes first reached from ``start`` (not walking
    past them) and the nodes walked on the way; a collective on the way raises, since the
    projections would then not see one rank's values."""
    seen, stack, found = {start}, [start], set()
    while stack:
        node = stack.pop()
        nexts = list(node.users) if forward else list(node.all_input_nodes)
        for n in nexts:
            if n in seen or n.op != "call_function":
                continue
            seen.add(n)
            if n.target is aten.linear.default:
                found.add(n)
            elif collective_of(n.target) is not None or n.target is WAIT:
                raise UnsupportedModelError(
                    f"comm='ag': a collective ({n.name}) lies between {start.name} and its projection; "
                    "use comm='a2a' or 'ag_rs'")
            else:
                stack.append(n)
    return found, seen


def _refuse_head_sharded_state(walked: set[torch.fx.Node], specs: dict[str, InputSpec], read: torch.fx.Node) -> None:
    """Every head now lives on every rank: a sharded parameter feeding a node of ``walked`` (the
    nodes computed from the query projection before the output projection), directly or through
    ops that are not linears (a per-head sink logit cast to the activations' dtype, say), would
    still hold only this rank's heads."""
    seen: set[torch.fx.Node] = set()
    order = {node: i for i, node in enumerate(read.graph.nodes)}  # graph order: the same error every run
    stack = [i for node in sorted(walked, key=order.__getitem__) for i in node.all_input_nodes if i not in walked]
    stack.reverse()  # pop the earliest first
    while stack:
        i = stack.pop()
        if i in seen:
            continue
        seen.add(i)
        if i.op == "call_function" and i.target is not aten.linear.default and i.target is not WAIT \
                and collective_of(i.target) is None:  # linears and collectives bound the attention
            stack.extend(x for x in i.all_input_nodes if x not in walked)
            continue
        spec = specs.get(i.name) if i.op == "placeholder" else None
        if spec is not None and spec.kind in STATE_KINDS and spec.shard.dim is not None:
            raise UnsupportedModelError(
                f"comm='ag': {read.name}'s attention uses {spec.target}, sharded by {spec.shard}, between its "
                "projections; use comm='a2a' or 'ag_rs'")


def _between(q_proj: torch.fx.Node, o_proj: torch.fx.Node) -> set[torch.fx.Node]:
    """The nodes computed from ``q_proj``'s output before ``o_proj`` (the context read, the
    new-token attention, their merge and everything on the way)."""
    seen: set[torch.fx.Node] = set()
    stack = [q_proj]
    while stack:
        for user in stack.pop().users:
            if user not in seen and user is not o_proj and user.op == "call_function":
                seen.add(user)
                stack.append(user)
    return seen


def _param_rule(linear: torch.fx.Node, specs: dict[str, InputSpec], rules: dict[str, ShardRule],
                want: ShardRule, what: str) -> str:
    weight = linear.args[1]
    spec = specs.get(weight.name)
    rule = rules.get(weight.name, spec.shard if spec is not None else None)
    if spec is None or spec.kind != PARAM or type(rule) is not ShardRule or rule != want:
        raise UnsupportedModelError(
            f"comm='ag' needs the {what} projection {linear.name} to be a plain "
            f"{'column' if want.dim == 0 else 'row'}-parallel linear (weight rule {want}), found {rule}; "
            "use comm='a2a' or 'ag_rs'")
    return weight.name


def _check_projections(read: torch.fx.Node, specs: dict[str, InputSpec], rules: dict[str, ShardRule], n: int,
                       tp: int) -> tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node | None]:
    """``(q_proj, o_proj, reduce)`` of ``read`` after every check :func:`replicate_projections`
    makes (``reduce``: the output projection's TP all-reduce, removed at ``n == tp``, else None),
    recording the new parameter rules in ``rules``; the graph is not changed. Raises
    :class:`UnsupportedModelError` naming ``a2a``/``ag_rs`` where ``comm="ag"`` cannot lower."""
    if read.target is not dcp_ops.paged_attention.default:
        raise UnsupportedModelError(f"comm='ag' shards paged context attention only, not {read.target}; "
                                    "use comm='a2a' or 'ag_rs'")
    q_linears, q_walked = _linears(read.args[0], forward=False)
    o_linears, o_walked = _linears(read, forward=True)
    _refuse_head_sharded_state((q_walked - q_linears) | (o_walked - o_linears), specs, read)
    if len(q_linears) != 1 or len(o_linears) != 1:
        raise UnsupportedModelError(
            f"comm='ag': {read.name} has query projections {sorted(n.name for n in q_linears)} and output "
            f"projections {sorted(n.name for n in o_linears)}, expected one each; use comm='a2a' or 'ag_rs'")
    (q_proj,), (o_proj,) = q_linears, o_linears
    _refuse_head_sharded_state(_between(q_proj, o_proj), specs, read)
    group_heads = REPLICATE if n == tp else ShardRule(0, tp // n)  # rank r: chunk r // n, its group's
    q_weight = _param_rule(q_proj, specs, rules, _COLWISE, "query")
    o_weight = _param_rule(o_proj, specs, rules, _ROWWISE, "output")
    rules[q_weight] = group_heads
    if len(q_proj.args) > 2 and q_proj.args[2] is not None:
        rules[q_proj.args[2].name] = group_heads
    if n != tp:
        return q_proj, o_proj, None
    (reduce,) = o_proj.users if len(o_proj.users) == 1 else (None,)
    if reduce is None or collective_of(reduce.target) is not ALL_REDUCE or coll.collective_group(reduce)[0] != "tp" \
            or len(reduce.users) != 1 or next(iter(reduce.users)).target is not WAIT:
        raise UnsupportedModelError(
            f"comm='ag': the output projection {o_proj.name} must feed one TP all-reduce of its own; "
            "use comm='a2a' or 'ag_rs'")
    rules[o_weight] = REPLICATE
    return q_proj, o_proj, reduce


def ag_rules(graph: torch.fx.Graph, specs: dict[str, InputSpec], n: int, tp: int) -> tuple[dict[str, ShardRule], str]:
    """``(rules, refusal)`` for lowering this TP-sharded graph with ``comm="ag"``: the parameter
    rules :func:`replicate_projections` would give, and ``""``; or ``({}, message)`` with the
    message it would raise for the first context read it refuses. The graph is not changed."""
    reads = context_reads(graph)
    rules: dict[str, ShardRule] = {}
    try:
        for read in reads:
            _check_projections(read, specs, rules, n, tp)
    except UnsupportedModelError as err:
        return {}, str(err)
    return rules, ""


def replicate_projections(graph: torch.fx.Graph, e, read: torch.fx.Node, specs: dict[str, InputSpec],
                          rules: dict[str, ShardRule], n: int, tp: int, dcp_rank: torch.fx.Node) -> None:
    """Give ``read``'s query projection every head of this rank's DCP group (``n`` of ``tp``
    ranks), recording the new weight (and bias) rules in ``rules``. With ``n == tp`` the output
    projection becomes whole too and its all-reduce is removed; otherwise it keeps its TP shard
    and reads only this rank's heads of the merged result (``dcp_rank``-th of ``n`` head blocks)."""
    _, o_proj, reduce = _check_projections(read, specs, rules, n, tp)
    if reduce is None:
        with graph.inserting_before(o_proj):  # [..., n·H·Dv] -> this rank's [..., H·Dv]
            blocks = e(aten.unflatten.int, o_proj.args[0], -1, [n, -1])
            mine = e(aten.squeeze.dim, e(aten.index_select.default, blocks, -2,
                                         e(aten.view.default, dcp_rank, [1])), -2)
        o_proj.args = (mine, *o_proj.args[1:])
        return
    wait = next(iter(reduce.users))
    wait.replace_all_uses_with(o_proj)
    graph.erase_node(wait)
    graph.erase_node(reduce)


def merge_all_heads(graph: torch.fx.Graph, e, o_c: torch.fx.Node, lse_c: torch.fx.Node, n: int, heads: int,
                    dv: int, out_dtype: torch.dtype, lse_dtype: torch.dtype) -> tuple[torch.fx.Node, torch.fx.Node]:
    """All-gather packed ``[o ‖ lse]`` (``[T, heads, Dv]`` and ``[T, heads]``, of dtypes
    ``out_dtype``/``lse_dtype``) of every head over the DCP group and merge every head: returns
    ``(out [T, heads, Dv] in out_dtype, lse [T, heads])``; exchange and merge run in fp32 or wider."""
    acc = torch.promote_types(torch.float32, out_dtype)
    o_acc = o_c if out_dtype == acc else e(aten._to_copy.default, o_c, dtype=acc)
    lse_acc = lse_c if lse_dtype == acc else e(aten._to_copy.default, lse_c, dtype=acc)
    packed = e(aten.cat.default, [o_acc, e(aten.unsqueeze.default, lse_acc, -1)], -1)  # [T, heads, Dv+1]
    parts = e(aten.view.default, coll.all_gather(graph, packed, n, "dcp"), [n, -1, heads, dv + 1])
    outs = e(aten.slice.Tensor, parts, -1, 0, dv)
    lses = e(aten.select.int, parts, -1, dv)
    merged, lse = e.pair(dcp_ops.merge_attention.default, outs, lses)
    return (merged if out_dtype == acc else e(aten._to_copy.default, merged, dtype=out_dtype)), lse
