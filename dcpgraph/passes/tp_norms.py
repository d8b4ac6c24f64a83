"""RMSNorms over a head-sharded width (``norm_colwise`` plan entries), for ``shard_tp``.

A norm over a projection's whole output (OLMo-2's ``q_norm`` over ``num_heads·head_dim``) or over
the attention output (BitNet's ``attn_sub_norm``) sees only rank ``r``'s columns once attention is
sharded by head. With ``m_r`` the mean of squares over rank ``r``'s ``w`` columns, the mean over
all ``tp·w`` columns is ``(1/tp)·Σ_r m_r``: one all-reduce of a ``[..., 1]`` tensor, divided by
``tp``. With KV heads replicated over ranks (``tp > n_kv``) each of the ``n_kv`` parts is held by
``tp / n_kv`` ranks, so the average over ranks is still the average over parts. The weight is split
as the width it normalises: like the linear that produces it (the query heads' split for the
attention output).
"""

from __future__ import annotations

from collections import deque

import torch
import torch.fx

from ..errors import UnsupportedModelError
from ..program import PARAM
from . import collectives as coll
from .graph_edit import Emitter
from .tp_styles import NORM, plan_rule

aten = torch.ops.aten


def _means_before(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The ``mean.dim`` nodes reached walking backwards from ``node`` before any linear."""
    found, seen, queue = [], {node}, deque([node])
    while queue:
        current = queue.popleft()
        if current.op == "call_function" and current.target is aten.mean.dim:
            found.append(current)
            continue
        if current.op == "call_function" and current.target is aten.linear.default:
            continue
        for arg in current.all_input_nodes:
            if arg not in seen:
                seen.add(arg)
                queue.append(arg)
    return found


def shard_norms(program, graph: torch.fx.Graph, plan: dict[str, str], specs, rules, assign, count, tp: int,
                kv_linears, nearest_linears) -> None:
    """Every ``norm_colwise`` weight: split like its input's width, its mean of squares averaged
    over the TP group. Refused by name where the norm is not an RMSNorm over the last dim."""
    if not any(style in NORM for style in plan.values()):
        return
    e = Emitter(graph)
    placeholders = {n.name: n for n in graph.nodes if n.op == "placeholder"}
    for spec in program.inputs:
        if spec.kind != PARAM or spec.name not in placeholders or not spec.target.endswith(".weight"):
            continue
        path = spec.target.removesuffix(".weight")
        if plan_rule(plan, path) not in NORM:
            continue
        weight = placeholders[spec.name]
        means = {m for user in weight.users for m in _means_before(user)}
        if len(means) != 1:
            raise UnsupportedModelError(
                f"{path}: a norm over a head-sharded width must be one RMSNorm (one mean of squares), "
                f"found {len(means)}; use tp=1")
        (mean,) = means
        dims = list(mean.args[1]) if len(mean.args) > 1 else []
        width = mean.args[0].meta["val"].dim() if "val" in mean.args[0].meta else None
        if len(dims) != 1 or (dims[0] != -1 and dims[0] != (width or 0) - 1):
            raise UnsupportedModelError(f"{path}: the norm's mean is over dims {dims}, not the last one; use tp=1")
        sources = nearest_linears(mean)
        preferred = [n for n in sources if n not in kv_linears] or list(sources)
        found = {rules.get(n.args[1].name) for n in preferred}
        if len(found) != 1 or None in found:
            raise UnsupportedModelError(
                f"{path}: the width it normalises comes from {len(found)} differently sharded projections; use tp=1")
        assign(weight, found.pop(), path)
        users = list(mean.users)
        with graph.inserting_before(mean.next):
            reduced = coll.all_reduce(graph, mean, "tp")
            averaged = e(aten.div.Tensor, reduced, tp)
        for user in users:
            user.replace_input_with(mean, averaged)
        count("norm_colwise")
