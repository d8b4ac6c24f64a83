"""Trace an HF causal LM built on the meta device: the graph and state shapes without any weights.

``torch.export`` runs on meta example inputs, so every device the forward names (``.to(device)``,
``arange(device=...)``) is recorded as ``meta``; :func:`_on_device` rewrites those to the device the
weights will live on before the verifier's shape propagation runs. ``Program.state`` then holds
meta tensors: their shapes and dtypes drive the passes, and :mod:`.loader` replaces them with each
rank's slices read from the checkpoint.
"""

from __future__ import annotations

import torch
import torch.fx

from ..frontends import hf
from ..frontends.export import finish
from ..program import Program

META = torch.device("meta")


def _swap(value, device: torch.device):
    if isinstance(value, torch.device) and value == META:
        return device
    if isinstance(value, (list, tuple)):
        return type(value)(_swap(v, device) for v in value)
    return value


def _on_device(graph: torch.fx.Graph, device: torch.device) -> int:
    """Replace every ``meta`` device argument in ``graph`` by ``device``; returns how many nodes changed."""
    changed = 0
    for node in graph.nodes:
        args = _swap(node.args, device)
        kwargs = {k: _swap(v, device) for k, v in node.kwargs.items()}
        if args != node.args or kwargs != node.kwargs:
            node.args, node.kwargs = args, kwargs
            changed += 1
    return changed


def trace_on_meta(model: torch.nn.Module, device: torch.device | str = "cpu") -> Program:
    """:func:`dcpgraph.trace` for an HF model whose parameters are on the meta device; the
    graph runs on ``device``. The state stays meta (shapes and dtypes only)."""
    ids, positions = hf.default_example_inputs(hf.model_facts(model), tokens=max(8, hf.min_trace_tokens(model) + 1))
    model.eval()
    program = hf.export_program(model, (ids.to(META), positions.to(META)))
    _on_device(program.graph_module.graph, torch.device(device))
    program.graph_module.recompile()
    return finish(program)
