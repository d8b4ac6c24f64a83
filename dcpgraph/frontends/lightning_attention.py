"""MiniMax lightning-attention layers as canonical weights, recognised by their parameters.

HF's ``MiniMaxLightningAttention`` holds ``qkv_proj [H·3D, hidden]`` (per head ``[q_h | k_h | v_h]``,
no bias), ``output_gate [H·D, hidden]``, ``norm`` (an RMSNorm over all ``H·D`` channels),
``out_proj [hidden, H·D]``, a SiLU ``act_fn`` and the decay buffer ``slope_rate [H, 1, 1]``:
``2^{−8(h+1)/H} · (1 − l/(L−1+1e−5) + 1e−5)`` for head ``h`` of layer ``l`` of ``L``, which HF
computes once per layer and keeps (so the traced layer reads it as a buffer, whatever its layer).
Its ``block_size`` sets the prefill block of the op.
"""

from __future__ import annotations

import torch

from ..errors import UnsupportedModelError
from ..ops.lightning_attention_layer import LightningAttentionWeights
from ..recurrent_state import LightningAttentionShape

REQUIRED = ("qkv_proj", "output_gate", "norm", "out_proj", "slope_rate", "act_fn", "block_size", "head_dim")


def is_lightning_attention(module: torch.nn.Module) -> bool:
    """Whether ``module`` has lightning attention's parameters and decay buffer."""
    return all(hasattr(module, name) for name in REQUIRED) and isinstance(module.slope_rate, torch.Tensor)


def shape_of(module: torch.nn.Module) -> LightningAttentionShape:
    return LightningAttentionShape(int(module.slope_rate.numel()), int(module.head_dim))


def canonical_weights(module: torch.nn.Module) -> LightningAttentionWeights:
    """The full canonical weights of an HF lightning-attention module; refuses by name a layout,
    bias or activation it does not know."""
    where = f"layer {getattr(module, 'layer_idx', '?')} ({type(module).__name__})"
    if not is_lightning_attention(module):
        raise UnsupportedModelError(f"{where}: not a recognised lightning attention layout (needs {list(REQUIRED)})")
    if type(module.act_fn).__name__ not in ("SiLU", "SiLUActivation"):
        raise UnsupportedModelError(f"{where}: qkv activation {type(module.act_fn).__name__} is not supported; "
                                    "supported: silu")
    s = shape_of(module)
    width = s.heads * s.head_dim
    linears = (module.qkv_proj, module.output_gate, module.out_proj)
    if any(getattr(m, "bias", None) is not None for m in linears):
        raise UnsupportedModelError(f"{where}: projection biases are not supported")
    if (module.qkv_proj.out_features, module.output_gate.out_features, module.out_proj.in_features,
            module.norm.weight.numel()) != (3 * width, width, width, width):
        raise UnsupportedModelError(f"{where}: qkv_proj, output_gate, out_proj and norm must match {s.heads} heads "
                                    f"of {s.head_dim}")
    return LightningAttentionWeights(
        head_dim=s.head_dim, block_size=int(module.block_size), w_qkv=module.qkv_proj.weight, slope=module.slope_rate,
        norm_weight=module.norm.weight, norm_eps=float(module.norm.variance_epsilon),
        w_gate=module.output_gate.weight, out_proj=module.out_proj.weight)
