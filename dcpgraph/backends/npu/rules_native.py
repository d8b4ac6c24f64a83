"""``linear_bf16`` and ``linear_f32`` → aten ``linear``; ``rms_norm_bf16``, ``rms_norm_f32`` and ``rotary_embedding`` → their aten chains.

These ops mean exactly what torch's ops mean (:mod:`dcpgraph.ops.linear`, :mod:`dcpgraph.ops.rms_norm`,
:mod:`dcpgraph.ops.rotary`); the passes that emit them (``native_linear``, ``native_rms_norm``,
``native_rotary``) only fire for CPU tensors (bf16; linear, RMSNorm and rotary also fp32, rotary fp16), which an Ascend
program meets when it is traced on the CPU before its weights move. On Ascend they become the
aten ops GE converts (``MatMulV2``/``BiasAdd``, the RMSNorm and rotary chains), so a program that
went through those passes lowers exactly as one that did not.
"""

from __future__ import annotations

import torch

from ...ops.rms_norm import rms_norm_reference
from ...ops.rms_norm_f32 import rms_norm_f32_reference
from ...ops.rotary import rotary_reference
from .rules import register

dcp_ops = torch.ops.dcpgraph


@register(dcp_ops.linear_bf16.default, "linear_bf16->linear")
def linear_bf16_as_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.nn.functional.linear(x, weight, bias)


@register(dcp_ops.linear_f32.default, "linear_f32->linear")
def linear_f32_as_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.nn.functional.linear(x, weight, bias)


@register(dcp_ops.rms_norm_bf16.default, "rms_norm_bf16->aten")
def rms_norm_bf16_as_aten(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return rms_norm_reference(x, weight, eps)


@register(dcp_ops.rms_norm_f32.default, "rms_norm_f32->aten")
def rms_norm_f32_as_aten(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return rms_norm_f32_reference(x, weight, eps)


@register(dcp_ops.rotary_embedding.default, "rotary_embedding->aten")
def rotary_embedding_as_aten(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return rotary_reference(x, cos, sin)
