"""Which nodes shape propagation may skip: a node whose operation and input metadata are those of
the run that computed its stored ``meta["val"]``.

After a pass most nodes of the new program are copies of the old program's nodes (``node.meta`` is
copied with them) with inputs whose fake values have the same shapes, dtypes and strides. Fake
execution is a function of exactly that (no real data enters it, and the programs have static
shapes), so running such a node again gives the same metadata. :func:`node_key` is that
function's argument: the node's ``op`` and ``target`` and its arguments with every input node
replaced by the metadata of its current value. :func:`propagate_shapes
<dcpgraph.passes.verify.propagate_shapes>` stores ``(key, val)`` in ``meta["shape_key"]`` and
reuses ``val`` only while ``meta["val"]`` is still that very object and the key is equal, so a pass
that changes a node's target or arguments, replaces its value, or changes any input's shape makes
it run again.

Never skipped: placeholders, attributes and outputs (cheap, and an attribute's tensor can be
replaced under the same name), module calls, and operators with mutable arguments (their fake
kernels may change an input's metadata). A graph holding an operator that changes a tensor's
metadata in place (``unsqueeze_``, ``resize_``, ...) is propagated whole.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx

SKIPPABLE_OPS = ("call_function", "call_method")
METADATA_MUTATING = frozenset({"as_strided_", "resize_", "resize_as_", "squeeze_", "unsqueeze_", "t_",
                               "transpose_", "swapdims_", "swapaxes_", "set_", "detach_"})


class Unkeyable(Exception):
    """An argument whose effect on fake execution this module does not know how to describe."""


def value_signature(value: Any) -> Any:
    """Hashable metadata of a node's value or a literal argument (raises :class:`Unkeyable`)."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype, value.device.type, tuple(value.stride()),
                value.storage_offset())
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(value_signature(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple(sorted((str(k), value_signature(v)) for k, v in value.items())))
    if isinstance(value, slice):
        return ("slice", value_signature(value.start), value_signature(value.stop), value_signature(value.step))
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device, torch.layout,
                                           torch.memory_format)):
        return (type(value).__name__, value)
    raise Unkeyable(type(value).__name__)


def _argument_signature(arg: Any) -> Any:
    if isinstance(arg, torch.fx.Node):
        if "val" not in arg.meta:
            raise Unkeyable("an input without a value")
        return ("node", value_signature(arg.meta["val"]))
    if isinstance(arg, (tuple, list)):
        return (type(arg).__name__, tuple(_argument_signature(a) for a in arg))
    if isinstance(arg, dict):
        return ("dict", tuple(sorted((str(k), _argument_signature(v)) for k, v in arg.items())))
    return value_signature(arg)


def mutates_arguments(target: Any) -> bool:
    schema = getattr(target, "_schema", None)
    return schema is not None and schema.is_mutable


def node_key(node: torch.fx.Node) -> Any | None:
    """The fake-execution key of ``node`` from its inputs' current values, or ``None`` where the
    node must always run."""
    if node.op not in SKIPPABLE_OPS or mutates_arguments(node.target):
        return None
    try:
        return (node.op, node.target, _argument_signature(node.args), _argument_signature(node.kwargs))
    except Unkeyable:
        return None


def mutates_metadata(graph: torch.fx.Graph) -> bool:
    """Any aten operator that changes a tensor's shape or strides in place."""
    for node in graph.nodes:
        if node.op == "call_function":
            name = getattr(node.target, "__name__", "").split(".")[0]
            if name in METADATA_MUTATING:
                return True
        elif node.op == "call_method" and node.target in METADATA_MUTATING:
            return True
    return False
