"""``native_rotary``: HF's rotary embedding of queries/keys → one ``dcpgraph.rotary_embedding`` op.

The traced chain (HF's ``apply_rotary_pos_emb``), every intermediate used only inside it::

    a = mul(x, cos)                                        (or mul(cos, x))
    r = cat([neg(slice(x, -1, D/2, end)), slice(x, -1, 0, D/2)], -1)
    y = add(a, mul(r, sin))                                (or mul(sin, r); either add order)

with ``x`` a 4-D CPU tensor ``[B, H, T, D]`` and ``cos``/``sin`` of its dtype, one the kernel
computes (bf16, fp16, fp32: :data:`dcpgraph.ops.rotary.DTYPES`), becomes
``y = rotary_embedding(x, cos, sin)``: the same three roundings in one pass, bit-identical
(:mod:`dcpgraph.ops.rotary`). It applies only where that kernel is built and past its self-check
in this process; fp64 programs never match. Interleaved (DeepSeek's complex) and partial rotary
chains are other patterns and stay as they are.
"""

from __future__ import annotations

import sys

import torch
import torch.fx

from ..ops import rotary as rotary_ops
from ..ops.rotary import DTYPES
from ..program import Program
from .graph_edit import replace_chains
from .manager import program_pass, ran

aten = torch.ops.aten


def _call(node, target) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is target


def _only_user(node: torch.fx.Node, user: torch.fx.Node) -> bool:
    return set(node.users) == {user}


def _val(node):
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _last_dim_slice(node, x, start, end, width) -> bool:
    """``node`` is ``slice(x, -1, start, end)`` (the last dim given as -1 or 3; an open end as D or
    the max int) read only by its one user."""
    if not (_call(node, aten.slice.Tensor) and node.args[0] is x and len(node.users) == 1 and not node.kwargs):
        return False
    dim, lo, hi = (list(node.args[1:]) + [0, 0, sys.maxsize])[:3]
    return dim in (-1, 3) and lo == start and (hi == end or (end == width and hi >= width))


def _rotate_half_of(node):
    """``x`` if ``node`` is ``cat([neg(x[..., D/2:]), x[..., :D/2]], -1)``, else None."""
    if not (_call(node, aten.cat.default) and len(node.args) == 2 and node.args[1] in (-1, 3)):
        return None
    parts = node.args[0]
    if not (isinstance(parts, (list, tuple)) and len(parts) == 2):
        return None
    neg, low = parts
    if not (_call(neg, aten.neg.default) and _only_user(neg, node)):
        return None
    high = neg.args[0]
    x = high.args[0] if _call(high, aten.slice.Tensor) else None
    val = _val(x)
    if val is None or val.dim() != 4 or val.shape[-1] % 2:
        return None
    width = val.shape[-1]
    if not (_last_dim_slice(high, x, width // 2, width, width) and _last_dim_slice(low, x, 0, width // 2, width)):
        return None
    return x


def match_rotary(out: torch.fx.Node):
    """``(x, cos, sin, chain)`` if ``out`` ends the chain in the module docstring, else None;
    ``chain`` lists the nodes the op replaces (``out`` last)."""
    if not (_call(out, aten.add.Tensor) and len(out.args) == 2 and not out.kwargs):
        return None
    for direct, rotated in (out.args, out.args[::-1]):
        if not (_call(direct, aten.mul.Tensor) and _call(rotated, aten.mul.Tensor)
                and _only_user(direct, out) and _only_user(rotated, out)):
            continue
        for r, sin in (rotated.args, rotated.args[::-1]):
            x = _rotate_half_of(r)
            if x is None or not _only_user(r, rotated):
                continue
            if direct.args[0] is x:
                cos = direct.args[1]
            elif direct.args[1] is x:
                cos = direct.args[0]
            else:
                continue
            vals = [_val(x), _val(cos), _val(sin), _val(out)]
            if any(v is None for v in vals) or vals[0].dtype not in DTYPES or any(
                    v.dtype != vals[0].dtype or v.device.type != "cpu" for v in vals):
                continue
            if vals[3].shape != vals[0].shape:  # cos/sin broadcast to x, not x to them
                continue
            neg, low = r.args[0]
            return x, cos, sin, [neg.args[0], neg, low, r, rotated, direct, out]
    return None


@program_pass(
    "native_rotary",
    requires=[ran("fuse_mla_preprocess", "its MLA preprocess patterns contain rotary chains")],
)
def native_rotary(program: Program, enabled: bool = True):
    if not enabled:
        return program, "disabled"
    found = [n for n in program.graph_module.graph.nodes if match_rotary(n)]
    if not found:
        return program, "no rotary chain"
    if not rotary_ops.native_enabled():
        return program, f"{len(found)} rotary chains kept as torch ops: {rotary_ops.reason()}"
    gm = program.copy_graph()

    def chain(node):
        found = match_rotary(node)
        return None if found is None else (found[:3], found[3])

    count = replace_chains(gm.graph, chain, torch.ops.dcpgraph.rotary_embedding.default)
    gm.recompile()
    return program.replace(graph_module=gm), f"{count} rotary chains → dcpgraph.rotary_embedding"
