"""Reading one FX node of a traced model: its example value, its shape, where it came from.

Every refusal raised while canonicalizing starts with :func:`describe_location`, so an
:class:`~dcpgraph.errors.UnsupportedModelError` always names the module path and class (from
export's ``nn_module_stack``) and the node it refuses.
"""

from __future__ import annotations

import torch
import torch.fx

from ...errors import UnsupportedModelError


def example_value(node: object) -> object:
    """The traced example value (``meta["val"]``) of an FX node; None for anything else."""
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def tensor_shape(node: object) -> tuple | None:
    """The (possibly symbolic) shape of a node whose example value is a tensor, else None."""
    val = example_value(node)
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def describe_location(node: torch.fx.Node) -> str:
    """``module.path (Class), node name`` from the export's module stack (``node name`` without
    one), for error messages."""
    stack = node.meta.get("nn_module_stack") or {}
    if stack:
        path, cls = list(stack.values())[-1]
        cls = cls.rsplit(".", 1)[-1] if isinstance(cls, str) else getattr(cls, "__name__", str(cls))
        if path:
            return f"{path} ({cls}), node {node.name}"
        return f"{cls}, node {node.name}"
    return f"node {node.name}"


def refuse(node: torch.fx.Node, what: str) -> UnsupportedModelError:
    """The error for an unsupported attention at ``node``: ``<location>: <what>``."""
    return UnsupportedModelError(f"{describe_location(node)}: {what}")
