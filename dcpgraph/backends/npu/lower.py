"""``lower_npu``: replace every dcpgraph op by its NPU or aten form before torchair's GE mode.

A pure FX pass, ``GraphModule -> new GraphModule``: the input GraphModule (the one
:class:`~dcpgraph.backends.fallback.FallbackGraph` runs eagerly if the compiled graph fails) is
never modified. It runs inside the torchair backend on the GraphModule torch.compile is handed,
not as a ``program_pass``: the lowered graph is only meaningful to torchair (its Ascend ops have
no CPU kernels), so it never becomes a Program.

GE ("max-autotune") needs a converter for every FX node and dcpgraph's ops have none, so each is
replaced by the first rule of :data:`~.rules.TABLE` whose checker accepts it (rules and their op
contracts: :mod:`.rules_attention`, :mod:`.rules_merge`, :mod:`.rules_cache`, :mod:`.rules_mlapo`,
:mod:`.rules_sparse`, :mod:`.rules_compressed`). Collectives stay
``_c10d_functional`` ops: torchair converts them to ``HcomAllGather``, ``HcomAllToAll(V)``,
``HcomReduceScatter``, ``HcomAllReduce``. Nodes a rule emitted that end up unused (an lse nobody
reads) are dropped.
"""

from __future__ import annotations

import collections
import copy
from collections.abc import Sequence

import torch
import torch.fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from . import (  # noqa: F401 - they register their rules
    rules_attention,
    rules_cache,
    rules_compressed,
    rules_merge,
    rules_mlapo,
    rules_native,
    rules_sparse,
)
from .ascend import GE_DECOMPOSITIONS
from .rules import TABLE, NpuLoweringError, Rule, Site
from .trace import LoweringTracer, splice

MERGE_MODES = ("auto", "npu", "aten")


def lower_npu(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence | None = None,
    *,
    merge: str = "auto",
    strict: bool = True,
) -> torch.fx.GraphModule:
    """A new GraphModule with every dcpgraph op replaced; ``meta['lower_npu']`` counts the rules used.

    Needs ``meta['val']`` on the dcpgraph ops and their inputs (every verified Program has it);
    otherwise pass ``example_inputs`` and fake values are propagated first. ``merge`` chooses
    among ``merge_attention``'s rules: ``"auto"`` tries ``npu_attention_update`` first and the aten
    merge where its limits do not allow it, ``"npu"`` requires it, ``"aten"`` never uses it.
    """
    if merge not in MERGE_MODES:
        raise ValueError(f"merge must be one of {MERGE_MODES}, got {merge!r}")
    new = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))  # nodes copied, meta values shared
    if example_inputs is not None and not _has_values(new.graph):
        FakeTensorProp(new).propagate(*example_inputs)
    graph = new.graph
    counts: collections.Counter[str] = collections.Counter()
    inserted: set[torch.fx.Node] = set()
    trace = LoweringTracer(GE_DECOMPOSITIONS)
    left: dict[str, str] = {}
    for node in list(graph.nodes):
        if node.op != "call_function" or not _is_dcpgraph_op(node.target):
            continue
        if not TABLE.rules_for(node.target):
            left[node.name] = f"{node.target}: no lowering rule"
            continue
        try:
            site = Site.of(node)
            rule = TABLE.choose(site, _candidates(node.target, merge))
            traced, inputs = trace(rule.lowering, node, rule.params(site))
        except NpuLoweringError as err:
            if strict:
                raise
            left[node.name] = f"{node.target}: {err}"
            continue
        inserted.update(splice(graph, node, traced, inputs, rule.name))
        counts[rule.name] += 1
    no_rule = [name for name, why in left.items() if why.endswith("no lowering rule")]
    if strict and no_rule:
        raise NpuLoweringError(f"dcpgraph ops left after lower_npu (no lowering rule): {no_rule}")
    graph.eliminate_dead_code(is_impure_node=lambda n: n not in inserted or n.is_impure())
    graph.lint()
    new.recompile()
    new.meta["lower_npu"] = dict(counts)
    new.meta["lower_npu_left"] = left
    return new


def _candidates(op, merge: str) -> tuple[Rule, ...]:
    rules = TABLE.rules_for(op)
    if op is torch.ops.dcpgraph.merge_attention.default and merge != "auto":
        rules = tuple(r for r in rules if r.uses == merge)
    return rules


def _is_dcpgraph_op(target) -> bool:
    return getattr(target, "namespace", None) == "dcpgraph"


def _has_values(graph: torch.fx.Graph) -> bool:
    """Every dcpgraph op and every node it reads carries ``meta['val']``."""
    ops = [n for n in graph.nodes if n.op == "call_function" and _is_dcpgraph_op(n.target)]
    return all("val" in n.meta for op in ops for n in (op, *op.all_input_nodes))
