"""Recurrent-state layouts of hybrid layers: shapes, TP split and bytes per request.

One shape class per recurrent kind: :class:`GatedDeltaNetShape` (below), :class:`ShortConvShape`,
:class:`Mamba2Shape`, :class:`LightningAttentionShape` and :class:`KimiDeltaShape`, each with its own byte
formula.

A GDN layer (HF ``qwen3_next``'s ``Qwen3NextGatedDeltaNet``) keeps two tensors per request, in
per-layer pools indexed by the request's state slot (``S`` slots):

- conv state ``[S, C, K−1]`` in the model's dtype: the last ``K−1`` inputs of the depthwise causal
  convolution over ``C = 2·Hk·Dk + Hv·Dv`` channels (query, key and value, in that order);
- recurrent state ``[S, Hv, Dk, Dv]`` in fp32: the delta-rule memory of every value head.

Per request, per GDN layer, on one rank of a TP group of ``tp``::

    conv_bytes      = (K − 1) · C_r · model_bytes,      C_r = 2·(Hk/t)·Dk + (Hv/t)·Dv
    recurrent_bytes = (Hv/t) · Dk · Dv · 4
    t = tp  when tp divides Hk (the layer is split by key-head groups, each with its Hv/Hk
            value heads, conv channels, gates and norm groups), else t = 1 (the whole layer
            and its state are replicated on every rank).

The state does not grow with context and does not depend on DCP: every rank of a DCP group runs
the recurrent layers on all of the step's tokens for its TP share of heads.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .errors import ConfigError, UnsupportedModelError

RECURRENT_STATE_DTYPE = torch.float32



def require_positive_ints(shape, kind: str) -> None:
    """Every field of the dataclass ``shape`` is a positive int (not a bool), or a ConfigError
    naming the ``kind`` of layer and the field."""
    for f in dataclasses.fields(shape):
        value = getattr(shape, f.name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{kind} {f.name} must be a positive int, got {value!r}")

@dataclass(frozen=True)
class GatedDeltaNetShape:
    """One GDN layer's head counts and dims (``key_heads`` Hk, ``value_heads`` Hv, ``key_dim`` Dk,
    ``value_dim`` Dv, ``conv_kernel`` K), validated on construction."""

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int

    def __post_init__(self) -> None:
        require_positive_ints(self, "gated delta net")
        if self.value_heads % self.key_heads:
            raise ConfigError(f"gated delta net value_heads ({self.value_heads}) must be a multiple of "
                              f"key_heads ({self.key_heads})")
        if self.conv_kernel < 2:
            raise ConfigError(f"gated delta net conv_kernel must be >= 2, got {self.conv_kernel}")

    @classmethod
    def from_config(cls, config) -> GatedDeltaNetShape:
        """From HF's ``linear_num_key_heads``, ``linear_num_value_heads``, ``linear_key_head_dim``,
        ``linear_value_head_dim`` and ``linear_conv_kernel_dim``."""
        return cls(config.linear_num_key_heads, config.linear_num_value_heads, config.linear_key_head_dim,
                   config.linear_value_head_dim, config.linear_conv_kernel_dim)

    @property
    def conv_channels(self) -> int:
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim

    def splits_over(self, tp: int) -> bool:
        """Whether a TP group of ``tp`` splits the layer by heads (else it is replicated)."""
        return self.key_heads % tp == 0

    def on_rank(self, tp: int) -> GatedDeltaNetShape:
        """The shape one rank holds: ``1/tp`` of the key and value heads where ``tp`` divides the
        key heads, else the whole layer (replicated)."""
        if tp < 1:
            raise ConfigError(f"tp must be >= 1, got {tp}")
        if not self.splits_over(tp):
            return self
        return GatedDeltaNetShape(self.key_heads // tp, self.value_heads // tp, self.key_dim, self.value_dim,
                                  self.conv_kernel)

    def conv_state_shape(self, slots: int) -> tuple[int, int, int]:
        return (slots, self.conv_channels, self.conv_kernel - 1)

    def recurrent_state_shape(self, slots: int) -> tuple[int, int, int, int]:
        return (slots, self.value_heads, self.key_dim, self.value_dim)

    def state_bytes_per_request(self, model_dtype: torch.dtype, tp: int = 1) -> int:
        """Bytes of one request's conv and recurrent state on one rank (the module's formula)."""
        local = self.on_rank(tp)
        conv = (local.conv_kernel - 1) * local.conv_channels * torch.empty((), dtype=model_dtype).element_size()
        recurrent = local.value_heads * local.key_dim * local.value_dim * RECURRENT_STATE_DTYPE.itemsize
        return conv + recurrent


@dataclass(frozen=True)
class ShortConvShape:
    """One short-convolution layer (HF ``lfm2``'s ``Lfm2ShortConv``): ``channels`` C (the hidden
    size) and ``conv_kernel`` K (``conv_L_cache``). Its state is the conv state ``[S, C_r, K−1]`` in
    the model's dtype, ``C_r = C/tp`` where ``tp`` divides ``C`` (the layer is split by channels),
    else ``C`` (replicated)::

        conv_bytes = (K − 1) · C_r · model_bytes
    """

    channels: int
    conv_kernel: int

    def __post_init__(self) -> None:
        require_positive_ints(self, "short conv")
        if self.conv_kernel < 2:
            raise ConfigError(f"short conv conv_kernel must be >= 2, got {self.conv_kernel}")

    def splits_over(self, tp: int) -> bool:
        return self.channels % tp == 0

    def on_rank(self, tp: int) -> ShortConvShape:
        if tp < 1:
            raise ConfigError(f"tp must be >= 1, got {tp}")
        return ShortConvShape(self.channels // tp, self.conv_kernel) if self.splits_over(tp) else self

    def conv_state_shape(self, slots: int) -> tuple[int, int, int]:
        return (slots, self.channels, self.conv_kernel - 1)

    def state_bytes_per_request(self, model_dtype: torch.dtype, tp: int = 1) -> int:
        local = self.on_rank(tp)
        return (local.conv_kernel - 1) * local.channels * torch.empty((), dtype=model_dtype).element_size()



@dataclass(frozen=True)
class Mamba2Shape:
    """One Mamba-2 mixer: ``heads`` Hh of ``head_dim`` P channels (``I = Hh·P``), ``groups`` G of
    B/C with ``state_size`` N, ``conv_kernel`` K. Per request it keeps, in the model's dtype, the
    conv state ``[I + 2·G·N, K−1]`` (the last inputs of the conv over ``[x | B | C]``) and, in
    fp32, the SSM state ``[Hh, P, N]`` (HF's cache holds the same two tensors per layer)::

        conv_bytes = (K − 1) · (I_r + 2·G_r·N) · model_bytes
        ssm_bytes  = Hh_r · P · N · 4
        (Hh_r, G_r, I_r) = (Hh/t, G/t, I/t),  t = tp where tp divides Hh and G, else 1 (replicated)
    """

    heads: int
    head_dim: int
    groups: int
    state_size: int
    conv_kernel: int

    def __post_init__(self) -> None:
        require_positive_ints(self, "mamba2")
        if self.heads % self.groups:
            raise ConfigError(f"mamba2 heads ({self.heads}) must be a multiple of groups ({self.groups})")
        if self.conv_kernel < 2:
            raise ConfigError(f"mamba2 conv_kernel must be >= 2, got {self.conv_kernel}")

    @property
    def conv_channels(self) -> int:
        return self.heads * self.head_dim + 2 * self.groups * self.state_size

    def splits_over(self, tp: int) -> bool:
        return self.heads % tp == 0 and self.groups % tp == 0

    def on_rank(self, tp: int) -> Mamba2Shape:
        if tp < 1:
            raise ConfigError(f"tp must be >= 1, got {tp}")
        if not self.splits_over(tp):
            return self
        return Mamba2Shape(self.heads // tp, self.head_dim, self.groups // tp, self.state_size, self.conv_kernel)

    def conv_state_shape(self, slots: int) -> tuple[int, int, int]:
        return (slots, self.conv_channels, self.conv_kernel - 1)

    def ssm_state_shape(self, slots: int) -> tuple[int, int, int, int]:
        return (slots, self.heads, self.head_dim, self.state_size)

    def state_bytes_per_request(self, model_dtype: torch.dtype, tp: int = 1) -> int:
        local = self.on_rank(tp)
        conv = (local.conv_kernel - 1) * local.conv_channels * torch.empty((), dtype=model_dtype).element_size()
        return conv + local.heads * local.head_dim * local.state_size * RECURRENT_STATE_DTYPE.itemsize

@dataclass(frozen=True)
class LightningAttentionShape:
    """One lightning-attention layer (HF ``minimax``'s ``MiniMaxLightningAttention``): ``heads`` H
    of ``head_dim`` D. Per request it keeps only the fp32 kv state ``[H_r, D, D]`` (HF's linear
    cache holds the same tensor), no conv state::

        kv_bytes = H_r · D · D · 4,      H_r = H/tp where tp divides H, else H (replicated)
    """

    heads: int
    head_dim: int

    def __post_init__(self) -> None:
        require_positive_ints(self, "lightning attention")

    def splits_over(self, tp: int) -> bool:
        return self.heads % tp == 0

    def on_rank(self, tp: int) -> LightningAttentionShape:
        if tp < 1:
            raise ConfigError(f"tp must be >= 1, got {tp}")
        return LightningAttentionShape(self.heads // tp, self.head_dim) if self.splits_over(tp) else self

    def kv_state_shape(self, slots: int) -> tuple[int, int, int, int]:
        return (slots, self.heads, self.head_dim, self.head_dim)

    def state_bytes_per_request(self, model_dtype: torch.dtype, tp: int = 1) -> int:
        """Bytes of one request's kv state on one rank (fp32 whatever ``model_dtype``)."""
        local = self.on_rank(tp)
        return local.heads * local.head_dim * local.head_dim * RECURRENT_STATE_DTYPE.itemsize


@dataclass(frozen=True)
class KimiDeltaShape:
    """One Kimi delta attention (KDA) layer: ``heads`` H of ``head_dim`` D channels for queries,
    keys and values alike, ``conv_kernel`` K. Per request it keeps, in the model's dtype, the conv
    state ``[3·H·D, K−1]`` (the last inputs of the conv over ``[q | k | v]``) and, in fp32, the
    recurrent state ``[H, D, D]``::

        conv_bytes      = (K − 1) · 3·(H/t)·D · model_bytes
        recurrent_bytes = (H/t) · D · D · 4
        t = tp where tp divides H (the layer is split by heads), else 1 (replicated)
    """

    heads: int
    head_dim: int
    conv_kernel: int

    def __post_init__(self) -> None:
        require_positive_ints(self, "kimi delta attention")
        if self.conv_kernel < 2:
            raise ConfigError(f"kimi delta attention conv_kernel must be >= 2, got {self.conv_kernel}")

    @classmethod
    def from_config(cls, config) -> KimiDeltaShape:
        """From HF's ``linear_num_heads``, ``linear_head_dim`` and ``linear_conv_kernel_dim``."""
        return cls(config.linear_num_heads, config.linear_head_dim, config.linear_conv_kernel_dim)

    @property
    def conv_channels(self) -> int:
        return 3 * self.heads * self.head_dim

    def splits_over(self, tp: int) -> bool:
        return self.heads % tp == 0

    def on_rank(self, tp: int) -> KimiDeltaShape:
        if tp < 1:
            raise ConfigError(f"tp must be >= 1, got {tp}")
        return KimiDeltaShape(self.heads // tp, self.head_dim, self.conv_kernel) if self.splits_over(tp) else self

    def conv_state_shape(self, slots: int) -> tuple[int, int, int]:
        return (slots, self.conv_channels, self.conv_kernel - 1)

    def recurrent_state_shape(self, slots: int) -> tuple[int, int, int, int]:
        return (slots, self.heads, self.head_dim, self.head_dim)

    def state_bytes_per_request(self, model_dtype: torch.dtype, tp: int = 1) -> int:
        local = self.on_rank(tp)
        conv = (local.conv_kernel - 1) * local.conv_channels * torch.empty((), dtype=model_dtype).element_size()
        return conv + local.heads * local.head_dim * local.head_dim * RECURRENT_STATE_DTYPE.itemsize


def refuse_recurrent_state_features(layers: list[int], speculative, draft_recurrent_layers=()) -> None:
    """Features that would need recurrent ``layers``' state at a point it is not kept, refused by
    name: MTP drafts (not implemented for
    hybrids); a draft model with recurrent layers of its own (``draft_recurrent_layers``: its
    state is not rolled back). Speculation with ``ngram`` or a draft model without recurrent
    layers is exact (:mod:`dcpgraph.runtime.state_rollback`), and so is prefix caching
    (:mod:`dcpgraph.runtime.state_prefix_cache`). ``speculative``: the checked
    :class:`~dcpgraph.runtime.speculative_config.SpeculativeConfig`, or None."""
    method = getattr(speculative, "method", None)
    if method == "draft_model" and draft_recurrent_layers:
        raise UnsupportedModelError(f"a draft model with recurrent layers ({sorted(draft_recurrent_layers)}) is not "
                                    "supported: its own state is not rolled back for rejected drafts; use a draft "
                                    "without recurrent layers (a small Llama or Qwen3 sharing the vocabulary)")
    if not layers:
        return
    if method == "mtp":
        raise UnsupportedModelError(f"speculative_config method 'mtp' is not supported with recurrent layers "
                                    f"({layers}): MTP drafting for hybrid targets is not implemented; use method "
                                    "'ngram' or 'draft_model'")
