"""Mamba-2 mixers of HF hybrid models as canonical weights.

Recognised structurally, by the parameters every HF Mamba-2 mixer has (``in_proj``, ``conv1d``,
``A_log``, ``D``, ``dt_bias``, ``norm``, ``out_proj``): ``bamba`` (``BambaMixer``), ``nemotron_h``
(``NemotronHMamba2Mixer``), ``granitemoehybrid`` (``GraniteMoeHybridMambaLayer``) and
``falcon_h1`` (``FalconH1Mixer``, with its µP multipliers ``ssm_in_multiplier`` and
``mup_vector``, its optional norm and ``norm_before_gate``). ``in_proj`` is laid out
``[z (I) | x (I) | B (G·N) | C (G·N) | dt (Hh)]``, the conv runs over ``[x | B | C]``.

Falcon-H1's layers run attention and the mixer in parallel on the same normed input; the
decoder layer's own forward (traced as is) combines them, so the mixer alone is what is
recognised here. :func:`tp_shard` splits the canonical weights by
:func:`~dcpgraph.ops.mamba2_layer.mamba2_tp_rule`; :mod:`dcpgraph.passes.shard_recurrent_tp`
applies the same split to a traced program's parameters.
"""

from __future__ import annotations

import dataclasses

import torch

from ..errors import UnsupportedModelError
from ..ops.mamba2_layer import Mamba2Weights
from ..recurrent_state import Mamba2Shape

REQUIRED = ("in_proj", "conv1d", "A_log", "D", "dt_bias", "norm", "out_proj")
SUPPORTED_ACTIVATIONS = ("silu",)


def is_mamba2(module: torch.nn.Module) -> bool:
    """Whether ``module`` has a Mamba-2 mixer's parameters."""
    return all(hasattr(module, name) for name in REQUIRED) and isinstance(module.conv1d, torch.nn.Conv1d)


def shape_of(module: torch.nn.Module) -> Mamba2Shape:
    return Mamba2Shape(int(module.num_heads), int(module.head_dim), int(module.n_groups), int(module.ssm_state_size),
                       int(module.conv_kernel_size))


def _norm_layout(module: torch.nn.Module, inner: int, where: str) -> tuple[torch.Tensor | None, int, float, bool]:
    """``(weight, groups, eps, norm_before_gate)`` of the mixer's gated norm (``None`` weight for
    falcon_h1's ``mamba_rms_norm=False``)."""
    norm = module.norm
    if isinstance(norm, torch.nn.Identity):
        return None, 1, 0.0, False
    weight, eps = getattr(norm, "weight", None), getattr(norm, "variance_epsilon", None)
    if weight is None or eps is None or weight.shape != (inner,):
        raise UnsupportedModelError(f"{where}: gated norm {type(norm).__name__} is not a recognised layout "
                                    f"(needs weight [{inner}] and variance_epsilon)")
    if hasattr(norm, "group_size"):
        groups = inner // int(norm.group_size)
    elif hasattr(norm, "n_groups"):
        groups = int(norm.n_groups)
    else:
        raise UnsupportedModelError(f"{where}: gated norm {type(norm).__name__} names neither group_size nor n_groups")
    return weight, groups, float(eps), bool(getattr(norm, "norm_before_gate", False))


def canonical_weights(module: torch.nn.Module) -> Mamba2Weights:
    """The full canonical weights of an HF Mamba-2 mixer; refuses by name a layout or activation
    it does not know."""
    where = f"layer {getattr(module, 'layer_idx', '?')} ({type(module).__name__})"
    if not is_mamba2(module):
        raise UnsupportedModelError(f"{where}: not a recognised Mamba-2 mixer (needs {list(REQUIRED)})")
    if getattr(module, "activation", None) not in SUPPORTED_ACTIVATIONS:
        raise UnsupportedModelError(f"{where}: conv activation {getattr(module, 'activation', None)!r} is not "
                                    f"supported; supported: {list(SUPPORTED_ACTIVATIONS)}")
    s = shape_of(module)
    inner = s.heads * s.head_dim
    conv = module.conv1d
    if int(getattr(module, "intermediate_size", inner)) != inner or conv.in_channels != s.conv_channels \
            or conv.groups != conv.in_channels or module.in_proj.out_features != inner + s.conv_channels + s.heads:
        raise UnsupportedModelError(
            f"{where}: in_proj [{module.in_proj.out_features}] / conv1d [{conv.in_channels}] do not match "
            f"heads·head_dim = {inner}, conv channels {s.conv_channels} (z | x, B, C | dt)")
    sizes = [inner, s.conv_channels, s.heads]
    w_z, w_xbc, w_dt = module.in_proj.weight.split(sizes, dim=0)
    bias = module.in_proj.bias
    b_z, b_xbc, b_dt = bias.split(sizes) if bias is not None else (None, None, None)
    norm_weight, norm_groups, eps, before_gate = _norm_layout(module, inner, where)
    dt_min, dt_max = (float(v) for v in module.time_step_limit)
    scales = {}
    mup = getattr(module, "mup_vector", None)
    if mup is not None:
        # a buffer computed from the config lives on the host while a checkpoint's parameters are
        # on the meta device: moved to theirs, the trace records the move to the ranks' device
        z_scale, xbc_scale, dt_scale = mup.to(module.in_proj.weight.device).reshape(-1).split(sizes)
        scales = dict(z_scale=z_scale, xbc_scale=xbc_scale, dt_scale=dt_scale)
    return Mamba2Weights(
        heads=s.heads, head_dim=s.head_dim, groups=s.groups, state_size=s.state_size,
        w_z=w_z, w_xbc=w_xbc, w_dt=w_dt, bias_z=b_z, bias_xbc=b_xbc, bias_dt=b_dt,
        conv_weight=conv.weight.squeeze(1), conv_bias=conv.bias,
        a_log=module.A_log, d=module.D, dt_bias=module.dt_bias,
        norm_weight=norm_weight, norm_groups=norm_groups, norm_eps=eps, norm_before_gate=before_gate,
        out_proj=module.out_proj.weight, out_bias=module.out_proj.bias,
        dt_min=dt_min, dt_max=dt_max, scan_chunk=int(module.chunk_size),
        in_multiplier=float(getattr(module, "ssm_in_multiplier", 1.0)), **scales,
    )


def tp_shard(full: Mamba2Weights, rank: int, tp: int) -> Mamba2Weights:
    """Rank ``rank``'s share of ``full`` in a TP group of ``tp``, by
    :func:`~dcpgraph.ops.mamba2_layer.mamba2_tp_rule`: heads ``[i·Hh/tp, (i+1)·Hh/tp)`` and groups
    ``[i·G/tp, (i+1)·G/tp)``, so the ranks' outputs sum to the layer's. The whole layer where
    ``tp`` does not divide both (as :meth:`~dcpgraph.recurrent_state.Mamba2Shape.on_rank` counts)."""
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} is outside a TP group of {tp}")
    if full.heads % tp or full.groups % tp:
        return full
    if full.norm_weight is not None and full.norm_groups % tp:
        raise UnsupportedModelError(f"a TP group of {tp} would split one of the gated norm's {full.norm_groups} "
                                    "groups; tp must divide the norm groups")
    inner, gn = full.heads * full.head_dim, full.groups * full.state_size

    def part(t, dim: int = 0):
        if t is None or isinstance(t, (int, float)):
            return t
        return t.chunk(tp, dim)[rank].contiguous()

    def xbc_part(t):  # each of the x, B, C segments: its own 1/tp
        if t is None or isinstance(t, (int, float)):
            return t
        x, b, c = t.split([inner, gn, gn], dim=0)
        return torch.cat([part(x), part(b), part(c)])

    return dataclasses.replace(
        full, heads=full.heads // tp, groups=full.groups // tp,
        w_z=part(full.w_z), w_xbc=xbc_part(full.w_xbc), w_dt=part(full.w_dt),
        bias_z=part(full.bias_z), bias_xbc=xbc_part(full.bias_xbc), bias_dt=part(full.bias_dt),
        conv_weight=xbc_part(full.conv_weight), conv_bias=xbc_part(full.conv_bias),
        a_log=part(full.a_log), d=part(full.d), dt_bias=part(full.dt_bias),
        norm_weight=part(full.norm_weight),
        norm_groups=full.norm_groups // tp if full.norm_weight is not None else full.norm_groups,
        out_proj=part(full.out_proj, 1), out_bias=full.out_bias if rank == 0 else None,
        z_scale=part(full.z_scale), xbc_scale=xbc_part(full.xbc_scale), dt_scale=part(full.dt_scale),
    )
