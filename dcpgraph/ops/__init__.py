"""Canonical ops (``torch.ops.dcpgraph.*``) and their Python entry points."""

from . import gated_delta, library, lightning_attention, mamba2
from .library import (
    attention,
    kv_cache_write_,
    merge_attention,
    paged_attention,
    partial_attention,
    rescale_to_global,
)
from .merge import merge_weights, sanitize_lse

__all__ = [
    "attention",
    "gated_delta",
    "kv_cache_write_",
    "library",
    "lightning_attention",
    "mamba2",
    "merge_attention",
    "merge_weights",
    "paged_attention",
    "partial_attention",
    "rescale_to_global",
    "sanitize_lse",
]
