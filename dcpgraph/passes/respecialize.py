"""Re-specialise shape literals that a trace baked in, after a pass changed tensor sizes.

Tracing records Python ints as literals: ``x.reshape(*x.shape[:-1], -1, 2)`` in a model becomes
``reshape(x, [1, 8, s0, -1, 2])`` with the head count 8 frozen. Once ``shard_tp`` gives a rank
4 heads, that reshape silently means something else. This walks the graph on fake tensors and,
before each shape-taking op, realigns its shape argument with its input:

- position rule: a literal ``S[i]`` equal to the input's *original* size at ``i`` (from the
  traced ``meta["val"]``) is replaced by the input's *current* size at ``i``;
- last-dim split rule (:func:`_split_last_dim`): a shape splitting the input's shrunk last dim
  into literal factors (``[..., heads, head_dim]``) has its outermost factor divided;
- element-count rule: with no ``-1`` and every entry a literal, if the shape holds ``f`` times
  the input's current element count, the one literal equal to an original size that shrank by
  exactly ``f`` (``before == f · now``) is divided by ``f``; with no such literal, or several, the
  shape is left as it is (and a wrong one fails shape propagation loudly).

Sizes that never changed are never touched, so an unsharded program is returned unchanged.
"""

from __future__ import annotations

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.node import map_arg

aten = torch.ops.aten
_SHAPE_OPS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default}
_NEW_OPS = {aten.new_empty.default, aten.new_zeros.default, aten.new_ones.default, aten.new_full.default}


def _concrete(size) -> int | None:
    return size if isinstance(size, int) else None


def _realign(shape: list, original: tuple, current: tuple) -> list | None:
    out = list(shape)
    changed = False
    for i, lit in enumerate(shape):
        if i < len(original) and i < len(current) and isinstance(lit, int) and lit != -1:
            before, now = _concrete(original[i]), _concrete(current[i])
            if before is not None and now is not None and lit == before and before != now:
                out[i] = now
                changed = True
    if changed:
        return out
    split = _split_last_dim(shape, original, current)
    if split is not None:
        return split
    if -1 in shape or not all(isinstance(x, int) for x in shape):
        return None
    numel_now = 1
    for x in current:
        numel_now *= int(x)
    numel_shape = 1
    for x in shape:
        numel_shape *= x
    if numel_shape == numel_now or numel_shape % numel_now:
        return None
    factor = numel_shape // numel_now
    shrunk = {
        before for before, now in zip(map(_concrete, original), map(_concrete, current))
        if before is not None and now is not None and before == factor * now
    }
    candidates = [i for i, lit in enumerate(shape) if lit in shrunk]
    if len(candidates) == 1:
        out[candidates[0]] //= factor
        return out
    return None


def _split_last_dim(shape: list, original: tuple, current: tuple) -> list | None:
    """Last-dim split rule: the input's last dim shrank ``f``-fold (``before == f · now``) and the
    shape splits it into literals ``[a, b, ...]`` at the same position whose product is ``before``
    (heads × head_dim, or heads × 3 × head_dim of a per-head fused qkv). A column shard keeps whole
    rows of the outermost factor, so ``a`` becomes ``a / f``."""
    last = len(original) - 1
    if last < 0 or len(current) != len(original) or len(shape) <= last + 1:
        return None
    before, now = _concrete(original[last]), _concrete(current[last])
    tail = shape[last:]
    if before is None or now is None or before == now or before % now or not all(
            isinstance(x, int) and x > 0 for x in tail):
        return None
    product = 1
    for x in tail:
        product *= x
    factor = before // now
    if product != before or tail[0] % factor:
        return None
    out = list(shape)
    out[last] = tail[0] // factor
    return out


def respecialize_shapes(gm: torch.fx.GraphModule, example_specs) -> int:
    """Fix baked-in shape literals of ``gm`` in place (the pass's own copy); returns how many."""
    fixed = 0
    with FakeTensorMode(allow_non_fake_inputs=True):
        args = iter([torch.empty(shape, dtype=dtype) for shape, dtype in example_specs])
        env: dict[torch.fx.Node, object] = {}
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                env[node] = next(args)
                continue
            if node.op == "output":
                break
            if node.op != "call_function":
                raise NotImplementedError(f"respecialize: unexpected {node.op} node {node.name}")
            source = node.args[0] if node.args else None
            if node.target in _SHAPE_OPS | _NEW_OPS and isinstance(source, torch.fx.Node):
                original = getattr(source.meta.get("val"), "shape", None)
                current = getattr(env.get(source), "shape", None)
                shape = node.args[1]
                if original is not None and current is not None and isinstance(shape, (list, tuple)):
                    new = _realign(list(shape), tuple(original), tuple(current))
                    if new is not None and new != list(shape):
                        node.args = (source, new, *node.args[2:])
                        fixed += 1
            args_ = map_arg(node.args, lambda n: env[n])
            kwargs_ = map_arg(node.kwargs, lambda n: env[n])
            env[node] = node.target(*args_, **kwargs_)
    return fixed
