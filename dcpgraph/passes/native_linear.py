"""``native_linear``: linears by bf16 CPU parameters → ``dcpgraph.linear_bf16``.

Every ``aten.linear(x, W, b?)`` whose weight ``W`` is a 2-D bf16 parameter (a state input of the
program) on the CPU becomes ``dcpgraph.linear_bf16(x, W, b?)``, an op with torch's meaning whose
CPU kernel runs few-row calls (decode) through the native kernel (AMX, AVX512-BF16, or AVX2 + FMA) and every other call
through ``torch.nn.functional.linear`` (the checker and the numerics: :mod:`dcpgraph.ops.linear`).
The pass applies only where that kernel is built and past its self-check in this process, so a
machine without it keeps plain ``aten.linear``; fp32/fp64 programs, activations-by-activations
products and weights on other devices are never touched, so their tokens are unchanged.

It runs last: earlier passes recognise ``aten.linear`` (``select_logits`` walks back to the LM
head, ``shard_tp`` and ``fuse_mla_preprocess`` match projections), and after ``shard_tp`` each
rank's weight is the local shard the op will read.
"""

from __future__ import annotations

import torch

from ..ops import linear as linear_ops
from ..program import STATE_KINDS, Program
from .manager import program_pass, ran

aten = torch.ops.aten


def _is_bf16_cpu_parameter(node, state_names: set[str]) -> bool:
    if not (isinstance(node, torch.fx.Node) and node.op == "placeholder" and node.name in state_names):
        return False
    val = node.meta.get("val")
    return (isinstance(val, torch.Tensor) and val.dtype == torch.bfloat16 and val.dim() == 2
            and val.device.type == "cpu")


@program_pass(
    "native_linear",
    requires=[
        ran("select_logits", "it finds the LM head as an aten.linear"),
        ran("shard_tp", "the op must read each rank's local weight shard"),
        ran("fuse_mla_preprocess", "it matches MLA projections as aten.linear"),
    ],
)
def native_linear(program: Program, enabled: bool = True):
    if not enabled:
        return program, "disabled"
    state_names = {s.name for s in program.inputs if s.kind in STATE_KINDS}
    gm = program.graph_module
    candidates = [
        n for n in gm.graph.nodes
        if n.op == "call_function" and n.target is aten.linear.default and _is_bf16_cpu_parameter(n.args[1], state_names)
    ]
    if not candidates:
        return program, "no linear by a bf16 CPU parameter"
    if not linear_ops.native_enabled():
        return program, f"{len(candidates)} bf16 linears kept on torch: {linear_ops.reason()}"
    gm = program.copy_graph()
    count = 0
    for node in gm.graph.nodes:
        if (node.op == "call_function" and node.target is aten.linear.default
                and _is_bf16_cpu_parameter(node.args[1], state_names)):
            node.target = torch.ops.dcpgraph.linear_bf16.default
            count += 1
    gm.recompile()
    return program.replace(graph_module=gm), f"{count} bf16 linears → dcpgraph.linear_bf16"
