"""``return_hidden_states``: the program also returns its final hidden states, for MTP drafting.

The final hidden state of every token of the step is the LM head's input (after the final
norm, the state vLLM's DeepSeek MTP reads). This pass adds it as output 1, ``[1, T, H]`` (all
``T`` tokens of the step, not only the logits rows: an MTP layer catches up over every computed
position). A DeepSeek-V4 model (hyper-connections) returns instead the input of its ``hc_head``,
the ``n = hc_mult`` streams after the last decoder layer, flattened to ``[1, T, n·H]``: the state
V4's MTP layer reads (:mod:`dcpgraph.speculative.mtp_v4_module`). It is the same on every rank of
a TP group (the residual stream is replicated after each layer's reduction) and DCP leaves it alone (DCP shards attention only), so rank 0's output
serves all. Output 0 (the logits) is unchanged; without this pass the program is as before.
"""

from __future__ import annotations

import torch

from ..errors import VerificationError
from ..program import Program
from .graph_edit import output_node
from .manager import holds, not_yet_run, program_pass, ran
from .select_logits import find_logits_linear

aten = torch.ops.aten


@program_pass(
    "return_hidden_states",
    requires=[
        ran("select_logits", "the LM head's input is then the selection of the hidden states"),
        not_yet_run("shard_tp", "its LM-head all-gather hides the logits linear from the walk back"),
        holds("no second output yet", lambda p: p.lowering.hidden_states_output is None),
    ],
)
def return_hidden_states(program: Program):
    gm = program.copy_graph()
    graph = gm.graph
    linear = find_logits_linear(graph)
    selected = linear.args[0]
    if not (selected.op == "call_function" and selected.target is aten.index_select.default):
        raise VerificationError(f"the LM head's input {selected.name} is not select_logits' row selection")
    hidden = selected.args[0]
    streams = hc_head_input(graph)
    if streams is not None:
        with graph.inserting_after(streams):
            hidden = graph.call_function(aten.flatten.using_ints, (streams, 2))
    out = output_node(graph)
    outputs = out.args[0]
    outputs = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
    out.args = (tuple([outputs[0], hidden, *outputs[1:]]),)
    gm.recompile()
    result = program.replace(graph_module=gm, lowering=program.lowering.decided(hidden_states_output=1))
    what = "the hc_head's input streams" if streams is not None else "the LM head's input"
    return result, f"output 1: {hidden.name}, {what} for every token"


def _module_path(node) -> str:
    """The innermost module a traced node belongs to (``nn_module_stack``), "" for none."""
    stack = node.meta.get("nn_module_stack") or {}
    return list(stack.values())[-1][0] if stack else ""


def hc_head_input(graph) -> torch.fx.Node | None:
    """The 4-D input ``[1, T, n, H]`` of the model's final ``hc_head`` (DeepSeek-V4's collapse of
    its hyper-connection streams), or None for a model without one; the one computed outside the
    module among the arguments of the nodes traced inside it (graph order)."""
    inside = [n for n in graph.nodes if n.op == "call_function" and _module_path(n).endswith("hc_head")
              and ".layers." not in _module_path(n)]
    names = {n.name for n in inside}
    found = []
    for node in inside:
        for arg in node.all_input_nodes:
            val = arg.meta.get("val")
            if arg.op == "call_function" and arg.name not in names and getattr(val, "dim", lambda: 0)() == 4 \
                    and arg not in found:
                found.append(arg)
    if len(found) > 1:
        raise VerificationError(f"hc_head reads several 4-D tensors {[n.name for n in found]}; expected the streams")
    return found[0] if found else None
