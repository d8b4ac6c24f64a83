"""``native_rms_norm``: HF's RMSNorm of bf16 or fp32 activations → one ``dcpgraph`` op.

The traced chain, every intermediate used only inside it (in fp32 the upcast, which returns ``x``
itself, may have other readers: it then stays for them)::

    h = to(x, float32); m = mean(pow(h, 2), [-1], keepdim=True); r = rsqrt(add(m, eps))
    y = mul(weight, to(mul(h, r), x.dtype))        (or mul(to(...), weight))

with ``x`` bf16 or fp32 on the CPU, ``eps`` a number and ``weight`` a 1-D program parameter of
``x``'s dtype and ``x.shape[-1]`` elements, becomes ``y = rms_norm_bf16(x, weight, eps)``
(:mod:`dcpgraph.ops.rms_norm`: the same two roundings in one pass over each row) or
``rms_norm_f32(x, weight, eps)`` (:mod:`dcpgraph.ops.rms_norm_f32`; in fp32 both casts return
their input). Both kernels take the mean from ATen's own reduction and repeat the rest's IEEE
operations, so the values are eager torch's. Each dtype's rewrite applies only where its kernel is
built and past its self-check in this process; fp64 programs never match. It runs after
``fuse_mla_preprocess``, whose patterns contain this chain.
"""

from __future__ import annotations

import torch
import torch.fx

from ..ops import rms_norm as rms_norm_ops
from ..ops import rms_norm_f32 as rms_norm_f32_ops
from ..program import STATE_KINDS, Program
from .graph_edit import replace_chains
from .manager import program_pass, ran

aten = torch.ops.aten

# activation dtype → (the op, its module: native_enabled() and reason(), its name in summaries)
_NATIVE = {
    torch.bfloat16: (torch.ops.dcpgraph.rms_norm_bf16.default, rms_norm_ops, "bf16"),
    torch.float32: (torch.ops.dcpgraph.rms_norm_f32.default, rms_norm_f32_ops, "fp32"),
}


def _call(node, target) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is target


def _only_user(node: torch.fx.Node, user: torch.fx.Node) -> bool:
    return set(node.users) == {user}


def _dtype(node) -> torch.dtype | None:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return val.dtype if isinstance(val, torch.Tensor) else None


def match_rms_norm(out: torch.fx.Node, state_names: set[str]):
    """``(x, weight, eps, chain)`` if ``out`` ends the chain in the module docstring, else None;
    ``chain`` lists the nodes the op replaces (``out`` last)."""
    if not _call(out, aten.mul.Tensor) or len(out.args) != 2:
        return None
    for weight, down in (out.args, out.args[::-1]):
        if not (isinstance(weight, torch.fx.Node) and weight.op == "placeholder" and weight.name in state_names):
            continue
        if not (_call(down, aten.to.dtype) and down.args[1] in _NATIVE and _only_user(down, out)
                and not down.kwargs):
            continue
        scaled = down.args[0]
        if not (_call(scaled, aten.mul.Tensor) and _only_user(scaled, down)):
            continue
        h, rsqrt = scaled.args
        if not (_call(rsqrt, aten.rsqrt.default) and _only_user(rsqrt, scaled)):
            continue
        add = rsqrt.args[0]
        if not (_call(add, aten.add.Tensor) and _only_user(add, rsqrt) and isinstance(add.args[1], float)):
            continue
        mean = add.args[0]
        if not (_call(mean, aten.mean.dim) and _only_user(mean, add) and list(mean.args[1]) == [-1]
                and len(mean.args) > 2 and mean.args[2] is True and not mean.kwargs):
            continue
        square = mean.args[0]
        if not (_call(square, aten.pow.Tensor_Scalar) and square.args[1] == 2 and _only_user(square, mean)):
            continue
        up = square.args[0]
        if not (up is h and _call(up, aten.to.dtype) and up.args[1] == torch.float32 and not up.kwargs
                and {square, scaled} <= set(up.users)):
            continue
        x = up.args[0]
        # an fp32 upcast of fp32 returns x itself, so other readers of it (HF's residual) may stay
        shared_up = set(up.users) != {square, scaled}
        if shared_up and _dtype(x) != torch.float32:
            continue
        w_val = weight.meta.get("val")
        x_val = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
        if not (isinstance(w_val, torch.Tensor) and isinstance(x_val, torch.Tensor)):
            continue
        if not (x_val.dtype == w_val.dtype == down.args[1] and w_val.dim() == 1
                and x_val.device.type == w_val.device.type == "cpu" and w_val.shape[0] == x_val.shape[-1]):
            continue
        chain = [square, mean, add, rsqrt, scaled, down, out]
        return x, weight, float(add.args[1]), chain if shared_up else [up, *chain]
    return None


@program_pass(
    "native_rms_norm",
    requires=[ran("fuse_mla_preprocess", "its MLA preprocess patterns contain RMSNorm chains")],
)
def native_rms_norm(program: Program, enabled: bool = True):
    if not enabled:
        return program, "disabled"
    state_names = {s.name for s in program.inputs if s.kind in STATE_KINDS}

    def dtype_of(node) -> torch.dtype | None:
        found = match_rms_norm(node, state_names)
        return None if found is None else _dtype(found[0])

    found: dict[torch.dtype, int] = {}
    for node in program.graph_module.graph.nodes:
        dtype = dtype_of(node)
        if dtype is not None:
            found[dtype] = found.get(dtype, 0) + 1
    if not found:
        return program, "no bf16 or fp32 RMSNorm chain"
    usable = {d for d in found if _NATIVE[d][1].native_enabled()}
    kept = [f"{found[d]} {_NATIVE[d][2]} RMSNorms kept as torch ops: {_NATIVE[d][1].reason()}"
            for d in found if d not in usable]
    if not usable:
        return program, "; ".join(kept)
    gm = program.copy_graph()
    done = []
    for dtype in _NATIVE:  # one dtype's chains at a time, in graph order
        if dtype not in usable:
            continue

        def chain(node, dtype=dtype):
            found = match_rms_norm(node, state_names)
            return None if found is None or _dtype(found[0]) != dtype else (found[:3], found[3])

        count = replace_chains(gm.graph, chain, _NATIVE[dtype][0])
        done.append(f"{count} {_NATIVE[dtype][2]} RMSNorms → dcpgraph.{_NATIVE[dtype][0].name().split('::')[1]}")
    gm.recompile()
    return program.replace(graph_module=gm), "; ".join(done + kept)
