"""``native_linear``: linears by bf16 or fp32 CPU parameters → ``dcpgraph.linear_bf16`` / ``linear_f32``.

Every ``aten.linear(x, W, b?)`` whose weight ``W`` is a 2-D bf16 (fp32) parameter (a state input
of the program) on the CPU becomes ``dcpgraph.linear_bf16(x, W, b?)`` (``dcpgraph.linear_f32``),
an op with torch's meaning whose CPU kernel runs few-row calls (decode) through a native kernel
that reads ``W`` once (:mod:`dcpgraph.ops.linear`, :mod:`dcpgraph.ops.linear_f32`) and every other
call through ``torch.nn.functional.linear``. Each dtype's rewrite applies only where its kernel is
built and past its self-check in this process, so a machine without it keeps plain
``aten.linear``; fp64 programs, activations-by-activations products and weights on other devices
are never touched. The fp32 kernel sums in another order than torch's GEMM (differences of order
1e-6 relative), as a TP all-reduce or a DCP merge already does.

It runs last: earlier passes recognise ``aten.linear`` (``select_logits`` walks back to the LM
head, ``shard_tp`` and ``fuse_mla_preprocess`` match projections), and after ``shard_tp`` each
rank's weight is the local shard the op will read.
"""

from __future__ import annotations

import torch

from ..ops import linear as linear_bf16_ops
from ..ops import linear_f32 as linear_f32_ops
from ..program import STATE_KINDS, Program
from .manager import program_pass, ran

aten = torch.ops.aten

# weight dtype → (the op, its module: native_enabled() and reason(), its name in summaries)
_NATIVE = {
    torch.bfloat16: (torch.ops.dcpgraph.linear_bf16.default, linear_bf16_ops, "bf16"),
    torch.float32: (torch.ops.dcpgraph.linear_f32.default, linear_f32_ops, "fp32"),
}


def _cpu_parameter_dtype(node, state_names: set[str]) -> torch.dtype | None:
    """The dtype of ``node`` if it is a 2-D CPU parameter of a dtype with a native linear, else None."""
    if not (isinstance(node, torch.fx.Node) and node.op == "placeholder" and node.name in state_names):
        return None
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor) and val.dim() == 2 and val.device.type == "cpu" and val.dtype in _NATIVE:
        return val.dtype
    return None


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

    def weight_dtype(node) -> torch.dtype | None:
        if node.op == "call_function" and node.target is aten.linear.default:
            return _cpu_parameter_dtype(node.args[1], state_names)
        return None

    found: dict[torch.dtype, int] = {}
    for node in program.graph_module.graph.nodes:
        dtype = weight_dtype(node)
        if dtype is not None:
            found[dtype] = found.get(dtype, 0) + 1
    if not found:
        return program, "no linear by a bf16 or fp32 CPU parameter"
    usable = {d for d in found if _NATIVE[d][1].native_enabled()}
    kept = [f"{found[d]} {_NATIVE[d][2]} linears kept on torch: {_NATIVE[d][1].reason()}" for d in found if d not in usable]
    if not usable:
        return program, "; ".join(kept)
    gm = program.copy_graph()
    done: dict[torch.dtype, int] = {}
    for node in gm.graph.nodes:
        dtype = weight_dtype(node)
        if dtype in usable:
            node.target = _NATIVE[dtype][0]
            done[dtype] = done.get(dtype, 0) + 1
    gm.recompile()
    summary = [f"{done[d]} {_NATIVE[d][2]} linears → dcpgraph.{_NATIVE[d][0].name().split('::')[1]}" for d in done]
    return program.replace(graph_module=gm), "; ".join(summary + kept)
