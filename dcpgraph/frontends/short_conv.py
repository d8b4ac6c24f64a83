"""LFM2 short-convolution layers as canonical weights, and their TP split by channels.

HF's ``Lfm2ShortConv`` projects ``in_proj [3C, H]`` into ``[B | C | x]`` (in that order), convolves
``B ⊙ x`` depthwise with ``conv [C, 1, K]`` and gates the result by ``C`` before ``out_proj``. Rank
``i`` of ``tp`` takes channels ``[i·C/tp, (i+1)·C/tp)`` of each of ``B``, ``C``, ``x``, the conv, and
``out_proj``'s columns; ``out_proj``'s bias is added by rank 0 only. Where ``tp`` does not divide
``C`` every rank holds the whole layer (complete output on each rank).
"""

from __future__ import annotations

import torch

from ..errors import UnsupportedModelError
from ..ops.short_conv_layer import ShortConvWeights
from ..recurrent_state import ShortConvShape

REQUIRED = ("in_proj", "conv", "out_proj", "conv_kernel_size")


def is_short_conv(module: torch.nn.Module) -> bool:
    return all(hasattr(module, name) for name in REQUIRED) and isinstance(module.conv, torch.nn.Conv1d)


def shape_of(module: torch.nn.Module) -> ShortConvShape:
    return ShortConvShape(int(module.conv.in_channels), int(module.conv_kernel_size))


def canonical_weights(module: torch.nn.Module) -> ShortConvWeights:
    """The full canonical weights of an HF short-conv module; refuses another layout by name.
    ``in_proj`` is viewed as ``[3, -1, H]``, so the traced parts hold no channel count."""
    where = f"layer {getattr(module, 'layer_idx', '?')} ({type(module).__name__})"
    if not is_short_conv(module):
        raise UnsupportedModelError(f"{where}: not a recognised short-convolution layout (needs {list(REQUIRED)})")
    channels = module.conv.in_channels
    if module.conv.groups != channels or module.in_proj.out_features != 3 * channels:
        raise UnsupportedModelError(f"{where}: the short convolution must be depthwise over in_proj's three "
                                    f"{channels}-channel parts")
    w_b, w_c, w_x = module.in_proj.weight.view(3, -1, module.in_proj.in_features).unbind(0)
    bias = module.in_proj.bias
    b_b, b_c, b_x = bias.view(3, -1).unbind(0) if bias is not None else (None, None, None)
    return ShortConvWeights(w_b=w_b, w_c=w_c, w_x=w_x, bias_b=b_b, bias_c=b_c, bias_x=b_x,
                            conv_weight=module.conv.weight.squeeze(1), conv_bias=module.conv.bias,
                            out_proj=module.out_proj.weight, out_bias=module.out_proj.bias)


def tp_shard(full: ShortConvWeights, rank: int, tp: int) -> ShortConvWeights:
    """Rank ``rank``'s share of ``full`` in a TP group of ``tp`` (see the module docstring)."""
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} is outside a TP group of {tp}")
    channels = full.conv_weight.shape[0]
    if channels % tp:
        return full

    def part(t: torch.Tensor | None, dim: int = 0) -> torch.Tensor | None:
        return None if t is None else t.chunk(tp, dim)[rank].contiguous()

    return ShortConvWeights(
        w_b=part(full.w_b), w_c=part(full.w_c), w_x=part(full.w_x),
        bias_b=part(full.bias_b), bias_c=part(full.bias_c), bias_x=part(full.bias_x),
        conv_weight=part(full.conv_weight), conv_bias=part(full.conv_bias),
        out_proj=part(full.out_proj, 1), out_bias=full.out_bias if rank == 0 else None,
    )
