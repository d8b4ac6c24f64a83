"""Kimi delta attention (KDA) layers of HF models as canonical weights.

Recognised structurally (by parameters, not class names): ``q_proj``, ``k_proj``, ``v_proj``, a
depthwise ``conv1d`` over ``[q | k | v]``, ``b_proj``, ``o_norm``, ``o_proj`` and a
``forget_gate`` holding ``dt_bias`` and ``A_log``, in one of the layouts transformers has:

- ``kimi_linear`` (``KimiLinearDeltaAttention``): low-rank forget gate ``f_a_proj``/``f_b_proj``
  with ``g = −exp(A_log)·softplus(f + dt_bias)``, low-rank output gate ``g_a_proj``/``g_b_proj``;
- ``bailing_hybrid`` (``BailingHybridDeltaAttention``): full-rank ``f_proj`` and ``g_proj``; with
  ``kda_safe_gate`` (its default) ``g = lower_bound·σ(exp(A_log)·(f + dt_bias))``, else the
  softplus form, rounded to the model's dtype before the rule as HF does;
- a low-rank forget gate with ``safe_gate_lower_bound`` (``glm5_next``'s layout) takes the bounded
  form where that bound is set.

Each becomes :class:`~dcpgraph.ops.kimi_delta_layer.KimiDeltaWeights`. Anything else under such
a module (projection biases, a conv activation other than SiLU) is refused by name.
"""

from __future__ import annotations

import torch

from ..errors import UnsupportedModelError
from ..ops.kimi_delta_layer import KimiDeltaWeights
from ..recurrent_state import KimiDeltaShape

COMMON = ("q_proj", "k_proj", "v_proj", "conv1d", "b_proj", "o_norm", "o_proj", "forget_gate")
FORGET_GATE_PARAMS = ("dt_bias", "A_log")
LOW_RANK_FORGET, FULL_FORGET = ("f_a_proj", "f_b_proj"), ("f_proj",)
LOW_RANK_GATE, FULL_GATE = ("g_a_proj", "g_b_proj"), ("g_proj",)
SUPPORTED_ACTIVATIONS = ("silu",)


def _has(module, names) -> bool:
    return all(hasattr(module, n) for n in names)


def is_kimi_delta(module: torch.nn.Module) -> bool:
    """Whether ``module`` has a recognised KDA layout's parameters."""
    if not _has(module, COMMON):
        return False
    gate = module.forget_gate
    return (isinstance(gate, torch.nn.Module) and _has(gate, FORGET_GATE_PARAMS)
            and (_has(gate, LOW_RANK_FORGET) or _has(gate, FULL_FORGET))
            and (_has(module, LOW_RANK_GATE) or _has(module, FULL_GATE)))


def shape_of(module: torch.nn.Module) -> KimiDeltaShape:
    return KimiDeltaShape(int(module.num_heads), int(module.head_dim), int(module.conv_kernel_size))


def _forget_form(gate: torch.nn.Module) -> tuple[str, float | None, bool]:
    """``(forget_gate, forget_bound, gate_in_model_dtype)`` of an HF forget gate."""
    if hasattr(gate, "safe_gate"):  # bailing_hybrid: the gate is rounded to the model's dtype
        return ("bounded", float(gate.lower_bound), True) if gate.safe_gate else ("softplus", None, True)
    bound = getattr(gate, "safe_gate_lower_bound", None)
    return ("bounded", float(bound), False) if bound is not None else ("softplus", None, False)


def canonical_weights(module: torch.nn.Module) -> KimiDeltaWeights:
    """The full (unsharded) canonical weights of an HF KDA module; refuses by name a layout it
    does not know."""
    where = f"layer {getattr(module, 'layer_idx', '?')} ({type(module).__name__})"
    if not is_kimi_delta(module):
        raise UnsupportedModelError(
            f"{where}: not a recognised Kimi delta attention layout (needs {list(COMMON)}, a forget_gate with "
            f"{list(FORGET_GATE_PARAMS)} and {list(LOW_RANK_FORGET)} or {list(FULL_FORGET)}, and "
            f"{list(LOW_RANK_GATE)} or {list(FULL_GATE)})")
    if getattr(module, "activation", None) not in SUPPORTED_ACTIVATIONS:
        raise UnsupportedModelError(f"{where}: conv activation {getattr(module, 'activation', None)!r} is not "
                                    f"supported; supported: {list(SUPPORTED_ACTIVATIONS)}")
    gate = module.forget_gate
    linears = [getattr(module, n) for n in ("q_proj", "k_proj", "v_proj", "b_proj", "o_proj", *LOW_RANK_GATE,
                                            *FULL_GATE) if hasattr(module, n)]
    linears += [getattr(gate, n) for n in (*LOW_RANK_FORGET, *FULL_FORGET) if hasattr(gate, n)]
    if any(getattr(lin, "bias", None) is not None for lin in linears):
        raise UnsupportedModelError(f"{where}: projection biases are not supported")
    s = shape_of(module)
    if gate.A_log.numel() != s.heads or gate.dt_bias.numel() != s.heads * s.head_dim:
        raise UnsupportedModelError(f"{where}: forget gate A_log {tuple(gate.A_log.shape)} / dt_bias "
                                    f"{tuple(gate.dt_bias.shape)} do not match {s.heads} heads of {s.head_dim}")
    form, bound, in_model_dtype = _forget_form(gate)
    low_rank_forget, low_rank_gate = _has(gate, LOW_RANK_FORGET), _has(module, LOW_RANK_GATE)
    return KimiDeltaWeights(
        heads=s.heads, head_dim=s.head_dim,
        w_q=module.q_proj.weight, w_k=module.k_proj.weight, w_v=module.v_proj.weight,
        conv_weight=module.conv1d.weight.squeeze(1), conv_bias=module.conv1d.bias,
        forget_down=gate.f_a_proj.weight if low_rank_forget else None,
        forget_up=gate.f_b_proj.weight if low_rank_forget else gate.f_proj.weight,
        dt_bias=gate.dt_bias, a_log=gate.A_log, forget_gate=form, forget_bound=bound,
        gate_in_model_dtype=in_model_dtype, w_b=module.b_proj.weight,
        gate_down=module.g_a_proj.weight if low_rank_gate else None,
        gate_up=module.g_b_proj.weight if low_rank_gate else module.g_proj.weight,
        norm_weight=module.o_norm.weight, norm_eps=float(module.o_norm.variance_epsilon),
        o_proj=module.o_proj.weight,
    )
