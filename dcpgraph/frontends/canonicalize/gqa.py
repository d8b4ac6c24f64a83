"""Seeing through grouped-query attention done by hand: repeated KV heads and transposed keys.

Models written for plain multi-head attention expand K/V from ``Hkv`` to ``Hq`` heads before
the score matmul. Canonical attention takes the un-repeated tensors, so the facts (and the KV
cache) see the real KV head count. Invariants:

- :func:`unrepeat` returns ``(source, n)`` with ``n > 1`` only when the node is, by construction
  of the ops it recognises, ``source`` with each head repeated ``n`` times along dim 1:
  ``repeat_interleave(x, n, dim=1)`` or HF's ``repeat_kv``
  (``reshape(expand(unsqueeze(x, 2), [b, h, n, s, d]), [b, h·n, s, d])``, no-op slices allowed
  between ``unsqueeze`` and ``expand``). Anything else is ``(node, 1)``.
- :func:`kv_sources` undoes the repeats only when K and V are repeated by the same factor;
  otherwise both come back unchanged (attention over repeated heads is still exact).
- :func:`untranspose` returns ``x`` only when the node swaps exactly the last two dims of ``x``.
"""

from __future__ import annotations

import torch
import torch.fx

from .nodes import tensor_shape

aten = torch.ops.aten

_RESHAPES = (aten.reshape.default, aten.view.default, aten._unsafe_view.default)


def _is_noop_slice(node: torch.fx.Node) -> bool:
    """``x[:, :, :]``-style slices export leaves in: start 0, end unbounded, step 1."""
    if node.target is not aten.slice.Tensor:
        return False
    args = list(node.args) + [None] * (5 - len(node.args))
    _, _dim, start, end, step = args[:5]
    return (start in (None, 0)) and (end is None or (isinstance(end, int) and end >= 2**62)) and step in (None, 1)


def unrepeat(node: torch.fx.Node) -> tuple[torch.fx.Node, int]:
    """``(source, n)`` when ``node`` repeats each head of ``source`` ``n`` times along dim 1,
    else ``(node, 1)``."""
    shape = tensor_shape(node)
    if node.op != "call_function" or shape is None or len(shape) != 4:
        return node, 1
    if node.target is aten.repeat_interleave.self_int:
        src, reps = node.args[0], node.args[1]
        dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
        src_shape = tensor_shape(src)
        if isinstance(reps, int) and dim in (1, -3) and src_shape and len(src_shape) == 4:
            return src, reps
        return node, 1
    if node.target in _RESHAPES:
        expand = node.args[0]
        if not (isinstance(expand, torch.fx.Node) and expand.target is aten.expand.default):
            return node, 1
        sizes = expand.args[1]
        src = expand.args[0]
        while isinstance(src, torch.fx.Node) and _is_noop_slice(src):
            src = src.args[0]
        if not (isinstance(src, torch.fx.Node) and src.target is aten.unsqueeze.default and src.args[1] == 2):
            return node, 1
        x = src.args[0]
        x_shape = tensor_shape(x)
        if len(sizes) == 5 and isinstance(sizes[2], int) and x_shape and len(x_shape) == 4:
            reps = sizes[2]
            if x_shape[1] * reps == shape[1]:
                return x, reps
    return node, 1


def kv_sources(k: torch.fx.Node, v: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node]:
    """``(k, v)`` before a GQA repeat both share, else ``(k, v)`` as given."""
    k_src, k_rep = unrepeat(k)
    v_src, v_rep = unrepeat(v)
    if k_rep == v_rep and k_rep > 1:
        return k_src, v_src
    return k, v


def untranspose(node: torch.fx.Node) -> torch.fx.Node | None:
    """``x`` if ``node`` is ``x`` with its last two dims swapped, else None."""
    if node.op != "call_function":
        return None
    shape = tensor_shape(node)
    rank = len(shape) if shape is not None else 4
    if node.target is aten.transpose.int:
        dims = {d % rank for d in node.args[1:3]}
        return node.args[0] if dims == {rank - 2, rank - 1} else None
    if node.target is aten.permute.default:
        perm = [d % rank for d in node.args[1]]
        return node.args[0] if perm == [*range(rank - 2), rank - 1, rank - 2] else None
    if node.target is aten.mT.default:
        return node.args[0]
    return None
