"""Recurrent layers of hybrid HF models, traced as canonical stateless ops.

While a model is exported, every module recognised structurally as a gated delta net
(:mod:`.gated_delta_net`), a Kimi delta attention (:mod:`.kimi_delta`), a short convolution
(:mod:`.short_conv`), a Mamba-2 mixer (:mod:`.mamba2`) or MiniMax's lightning attention
(:mod:`.lightning_attention`) runs dcpgraph's formula of the layer instead of its own forward: the
projections stay ordinary linears of the module's own parameters (so the state keys are the
checkpoint's names), and the state-carrying parts become ``dcpgraph.causal_conv1d``,
``dcpgraph.gated_delta_rule``, ``dcpgraph.kimi_delta_rule``, ``dcpgraph.mamba2_scan`` and
``dcpgraph.lightning_attention`` over the
traced sequence, from a zero state. The traced forward is one causal sequence, so this is the layer's exact function of it.

A config layer type that keeps recurrent state (``linear_attention``, ``conv``, ``hybrid``) is
accepted only where the decoder layer holds a module recognised here
(:func:`unrecognised_recurrent_layers`); any other (Mamba-1…) stays
refused by name. Attention-free ``mlp``/``moe`` layers (nemotron_h) are
accepted where the decoder layer provably holds no state (:func:`stateless_layers`).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator

import torch

from ..ops.gated_delta_layer import gated_delta_net_canonical
from ..ops.kimi_delta_layer import kimi_delta_attention_canonical
from ..ops.lightning_attention_layer import lightning_attention_canonical
from ..ops.mamba2_layer import mamba2_mixer_canonical
from ..ops.short_conv_layer import short_conv_canonical
from . import gated_delta_net, kimi_delta, lightning_attention, mamba2, short_conv

# Config layer type → the recognised kinds such a layer may hold.
RECURRENT_LAYER_TYPES = {"linear_attention": ("gated delta net", "kimi delta attention", "mamba2", "lightning attention"),
                         "conv": ("short convolution",), "hybrid": ("mamba2",)}
# The config attributes that declare each recognised kind's dimensions (qwen3_next/qwen3_5's
# ``linear_num_value_heads``, lfm2's ``conv_L_cache``, the Mamba-2 hybrids' head counts): what a
# config-only check can go by.
_DECLARED_BY = {"gated delta net": ("linear_num_value_heads",), "kimi delta attention": ("linear_num_heads",),
                "short convolution": ("conv_L_cache",), "mamba2": ("mamba_n_heads", "mamba_num_heads"),
                "lightning attention": ("linear_attn_alpha_factor",)}
_RECOGNISERS = {"gated delta net": gated_delta_net.is_gated_delta_net, "kimi delta attention": kimi_delta.is_kimi_delta,
                "short convolution": short_conv.is_short_conv, "mamba2": mamba2.is_mamba2,
                "lightning attention": lightning_attention.is_lightning_attention}
# Layer types that hold only an MLP or MoE (nemotron_h's ``-`` and ``E`` blocks): no attention, no state.
STATELESS_LAYER_TYPES = ("mlp", "moe")


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
            and found.get(i, (None,))[0] not in RECURRENT_LAYER_TYPES[kind]]


def stateless_layers(model: torch.nn.Module, layer_types: list[str]) -> list[int]:
    """Layers typed ``mlp``/``moe`` whose decoder layer holds no recognised recurrent module, no
    convolution, no SSM parameter (``A_log``) and no attention projection (``q_proj``,
    ``qkv_proj``): they compute from the current token alone, so nothing needs caching."""
    layers = decoder_layers(model) or ()
    found = []
    for i, kind in enumerate(layer_types):
        if kind not in STATELESS_LAYER_TYPES or i >= len(layers):
            continue
        if any(isinstance(m, torch.nn.Conv1d) or any(test(m) for test in _RECOGNISERS.values())
               or any(hasattr(m, name) for name in ("A_log", "q_proj", "qkv_proj")) for m in layers[i].modules()):
            continue
        found.append(i)
    return found


def declared_recurrent_layers(config) -> list[int]:
    """From the config alone (before a model exists): layers whose type keeps recurrent state of a
    kind the config declares the dimensions of. The structural check on the built model
    (:func:`unrecognised_recurrent_layers`) still decides at trace time."""
    types = list(getattr(config, "layer_types", None) or ())
    return [i for i, kind in enumerate(types) if kind in RECURRENT_LAYER_TYPES
            and any(getattr(config, name, None) is not None
                    for k in RECURRENT_LAYER_TYPES[kind] for name in _DECLARED_BY[k])]


def declared_stateless_layers(config) -> list[int]:
    """From the config alone: ``mlp``/``moe`` layers of a config that declares Mamba-2 mixers
    (nemotron_h's pattern). :func:`stateless_layers` on the built model still decides at trace
    time."""
    if not any(getattr(config, name, None) is not None for name in _DECLARED_BY["mamba2"]):
        return []
    return [i for i, kind in enumerate(getattr(config, "layer_types", None) or ()) if kind in STATELESS_LAYER_TYPES]


def _canonical_gated_delta_net(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    weights = gated_delta_net.canonical_weights(self)
    return torch.stack([gated_delta_net_canonical(weights, row) for row in hidden_states])


def _canonical_kimi_delta(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    weights = kimi_delta.canonical_weights(self)
    return torch.stack([kimi_delta_attention_canonical(weights, row) for row in hidden_states])


def _canonical_short_conv(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    weights = short_conv.canonical_weights(self)
    return torch.stack([short_conv_canonical(weights, row) for row in hidden_states])


def _canonical_mamba2(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    weights = mamba2.canonical_weights(self)
    return torch.stack([mamba2_mixer_canonical(weights, row) for row in hidden_states])


def _canonical_lightning_attention(self, hidden_states: torch.Tensor, *args, **kwargs):
    """``(output, None)``: MiniMax's decoder layer unpacks the attention's ``(output, weights)``."""
    weights = lightning_attention.canonical_weights(self)
    return torch.stack([lightning_attention_canonical(weights, row) for row in hidden_states]), None


_FORWARDS = {"gated delta net": _canonical_gated_delta_net, "kimi delta attention": _canonical_kimi_delta,
             "short convolution": _canonical_short_conv,
             "mamba2": _canonical_mamba2, "lightning attention": _canonical_lightning_attention}


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
