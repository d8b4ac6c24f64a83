"""Quantized checkpoints: which ones the loader reads, and the sources that dequantize them.

Supported: fp8 block quantization as DeepSeek-V3/V3.2 and Qwen3's FP8 checkpoints ship it
(``quantization_config = {"quant_method": "fp8", "weight_block_size": [r, c], ...}``): every
quantized linear weight ``<name>`` is ``float8_e4m3fn`` with an fp32 ``<name>_scale_inv`` of one
scale per ``r × c`` tile. Each such weight becomes a :class:`~.tensor_sources.BlockDequantized`
source, so a rank dequantizes only the slice it owns, once, at load (the program then runs in the
checkpoint's unquantized dtype: bf16 for these models). Any other ``quantization_config`` is
refused by name before anything is read.
"""

from __future__ import annotations

from dataclasses import replace

from ..errors import ConfigError
from .tensor_sources import (
    AbsorbedMLA,
    BlockDequantized,
    Concatenated,
    SafetensorsFiles,
    Stacked,
    Stored,
)

SCALE_SUFFIX = "_scale_inv"


def fp8_block_size(config, path: str) -> tuple[int, int] | None:
    """The checkpoint's fp8 tile ``(rows, cols)``; None when it is not quantized; ConfigError for
    a quantization this loader does not read."""
    quant = getattr(config, "quantization_config", None)
    if not quant:
        return None
    get = quant.get if isinstance(quant, dict) else (lambda key, default=None: getattr(quant, key, default))
    method, block = get("quant_method"), get("weight_block_size")
    if method == "fp8" and block is not None and len(block) == 2 and all(int(b) > 0 for b in block):
        return int(block[0]), int(block[1])
    raise ConfigError(f"{path}: quantization_config {{quant_method: {method!r}, weight_block_size: {block!r}}} is "
                      "not supported; dcpgraph reads unquantized checkpoints and fp8 block-quantized ones "
                      "(quant_method 'fp8' with weight_block_size, DeepSeek-V3's format)")


def dequantized(source, files: SafetensorsFiles, block: tuple[int, int]):
    """``source`` with every stored weight that has a ``_scale_inv`` companion dequantized."""
    if isinstance(source, Stored):
        scale = source.name + SCALE_SUFFIX
        return BlockDequantized(source, Stored(files, scale), block) if scale in files else source
    if isinstance(source, (Stacked, Concatenated)):
        return replace(source, parts=tuple(dequantized(p, files, block) for p in source.parts))
    if isinstance(source, AbsorbedMLA):
        return replace(source, up=dequantized(source.up, files, block))
    return source


def dequantized_sources(sources: dict[str, object], files: SafetensorsFiles,
                        block: tuple[int, int] | None) -> dict[str, object]:
    """Every source of ``sources`` :func:`dequantized` (unchanged when ``block`` is None: an
    unquantized checkpoint)."""
    if block is None:
        return sources
    return {name: dequantized(source, files, block) for name, source in sources.items()}
