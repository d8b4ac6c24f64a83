"""Recurrent layers of hybrid HF models, traced as canonical stateless ops.

While a model is exported, every module recognised structurally as a gated delta net
(:mod:`.gated_delta_net`) or a short convolution (:mod:`.short_conv`) runs dcpgraph's formula of
the layer instead of its own forward: the projections stay ordinary linears of the module's own
parameters (so the state keys are the checkpoint's names), and the state-carrying parts become
``dcpgraph.causal_conv1d`` and ``dcpgraph.gated_delta_rule`` over the traced sequence, from a zero
state. The traced forward is one causal sequence, so this is the layer's exact function of it.

A config layer type that keeps recurrent state (``linear_attention``, ``conv``) is accepted only
where the decoder layer holds a module recognised here (:func:`unrecognised_recurrent_layers`);
any other (Mamba/SSM, Kimi delta attention, lightning attention…) stays refused by name.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator

import torch

from ..ops.gated_delta_layer import gated_delta_net_canonical
from ..ops.short_conv_layer import short_conv_canonical
from . import gated_delta_net, short_conv

RECURRENT_LAYER_TYPES = {"linear_attention": "gated delta net", "conv": "short convolution"}
# The config attribute that declares each recognised kind's dimensions (qwen3_next/qwen3_5's
# ``linear_num_value_heads``, lfm2's ``conv_L_cache``): what a config-only check can go by.
_DECLARED_BY = {"gated delta net": "linear_num_value_heads", "short convolution": "conv_L_cache"}
_RECOGNISERS = {"gated delta net": gated_delta_net.is_gated_delta_net, "short convolution": short_conv.is_short_conv}


def decoder_layers(model: torch.nn.Module):
    """The decoder layers of an HF causal LM (``<base>.layers``), or ``None``."""
    base = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    layers = getattr(base, "layers", None)
    return layers if isinstance(layers, torch.nn.ModuleList) else None


def recurrent_modules(model: torch.nn.Module) -> dict[int, tuple[str, torch.nn.Module]]:
    """Layer index → (kind, module) of every recognised recurrent module in a decoder layer."""
    found = {}
    for i, layer in enumerate(decoder_layers(model) or ()):
        for module in layer.modules():
            kind = next((k for k, test in _RECOGNISERS.items() if test(module)), None)
            if kind is not None:
                found[i] = (kind, module)
                break
    return found


def unrecognised_recurrent_layers(model: torch.nn.Module, layer_types: list[str]) -> list[int]:
    """Layers whose config type keeps recurrent state but which hold no module of that kind
    recognised here."""
    found = recurrent_modules(model)
    return [i for i, kind in enumerate(layer_types) if kind in RECURRENT_LAYER_TYPES
            and found.get(i, (None,))[0] != RECURRENT_LAYER_TYPES[kind]]


def declared_recurrent_layers(config) -> list[int]:
    """From the config alone (before a model exists): layers whose type keeps recurrent state of a
    kind the config declares the dimensions of. The structural check on the built model
    (:func:`unrecognised_recurrent_layers`) still decides at trace time."""
    types = list(getattr(config, "layer_types", None) or ())
    return [i for i, kind in enumerate(types) if kind in RECURRENT_LAYER_TYPES
            and getattr(config, _DECLARED_BY[RECURRENT_LAYER_TYPES[kind]], None) is not None]


def _canonical_gated_delta_net(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    weights = gated_delta_net.canonical_weights(self)
    return torch.stack([gated_delta_net_canonical(weights, row) for row in hidden_states])


def _canonical_short_conv(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    weights = short_conv.canonical_weights(self)
    return torch.stack([short_conv_canonical(weights, row) for row in hidden_states])


_FORWARDS = {"gated delta net": _canonical_gated_delta_net, "short convolution": _canonical_short_conv}


@contextlib.contextmanager
def canonical_recurrent_layers(model: torch.nn.Module) -> Iterator[dict[int, str]]:
    """Inside the block, every recognised recurrent module computes its canonical form; yields
    layer index → kind. The modules' own forwards are restored on exit."""
    found = recurrent_modules(model)
    patched = []
    try:
        for kind, module in found.values():
            patched.append(module)
            module.forward = types.MethodType(_FORWARDS[kind], module)
        yield {i: kind for i, (kind, _) in found.items()}
    finally:
        for module in patched:
            del module.forward
