"""``select_logits``: compute the LM head only for the rows that will be sampled.

The traced model produces logits for every token of the step; the engine samples one row per
request (its last scheduled token). This pass finds the linear that produces the logits (walking
back from the first output through shape-only and elementwise ops) and selects the rows given by
a ``logits_indices [R]`` input before it: ``lm_head(h)[idx] == lm_head(h[idx])`` row by row, so
nothing changes but the cost: a step computes ``R × vocab`` logits instead of ``T × vocab``.
"""

from __future__ import annotations

import torch

from ..errors import VerificationError
from ..program import META, InputSpec, Program
from .graph_edit import Emitter, add_placeholders, output_node
from .manager import not_yet_run, program_pass

aten = torch.ops.aten
_PASS_THROUGH = {
    aten.slice.Tensor, aten.view.default, aten.reshape.default, aten._to_copy.default,
    aten.to.dtype, aten.contiguous.default, aten.alias.default, aten.clone.default,
    aten.div.Tensor, aten.mul.Tensor, aten.tanh.default,
}


def find_logits_linear(graph: torch.fx.Graph) -> torch.fx.Node:
    node = output_node(graph).args[0]
    node = node[0] if isinstance(node, (tuple, list)) else node
    while node.op == "call_function" and node.target in _PASS_THROUGH:
        node = node.args[0]
    if node.op != "call_function" or node.target is not aten.linear.default:
        raise VerificationError(f"could not find the LM head linear (stopped at {node.name}: {node.target})")
    return node


@program_pass(
    "select_logits",
    requires=[not_yet_run("shard_tp", "its LM-head all-gather hides the logits linear from the walk back")],
)
def select_logits(program: Program):
    gm = program.copy_graph()
    graph = gm.graph
    linear = find_logits_linear(graph)
    (indices,) = add_placeholders(graph, ["logits_indices"])
    with graph.inserting_before(linear):
        selected = Emitter(graph)(aten.index_select.default, linear.args[0], 1, indices)
    linear.args = (selected, *linear.args[1:])
    gm.recompile()
    inputs = (*program.inputs, InputSpec("logits_indices", META, "logits_indices"))
    return program.replace(graph_module=gm, inputs=inputs), f"LM head {linear.name} computes selected rows only"
