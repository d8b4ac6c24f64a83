"""``return_hidden_states``: the program also returns its final hidden states, for MTP drafting.

The final hidden state of every token of the step is the LM head's input (after the final
norm, the state vLLM's DeepSeek MTP reads). This pass adds it as output 1, ``[1, T, H]`` (all
``T`` tokens of the step, not only the logits rows: an MTP layer catches up over every computed
position). It is the same on every rank of a TP group (the residual stream is replicated after
each layer's reduction) and DCP leaves it alone (DCP shards attention only), so rank 0's output
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
    out = output_node(graph)
    outputs = out.args[0]
    outputs = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
    out.args = (tuple([outputs[0], hidden, *outputs[1:]]),)
    gm.recompile()
    result = program.replace(graph_module=gm, lowering=program.lowering.decided(hidden_states_output=1))
    return result, f"output 1: {hidden.name}, the LM head's input for every token"
