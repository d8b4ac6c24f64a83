"""What the Ascend stack provides to a lowering, looked up lazily, and what GE cannot convert.

On Ascend ``torch.ops.npu.*`` come from libtorch_npu.so and ``torch.ops.air.*`` from importing
torchair; where they are missing (and no test tier declared them) the lookup raises
:class:`~.rules.NpuLoweringError` naming what is missing. Rules that emit only aten need neither.
"""

from __future__ import annotations

import torch

from .rules import NpuLoweringError

aten = torch.ops.aten


def _has_op(namespace: str, name: str) -> bool:
    try:
        getattr(getattr(torch.ops, namespace), name)
    except (AttributeError, RuntimeError):
        return False
    return True


def fias_op():
    """``torch.ops.air.npu_fused_infer_attention_score.default`` (registered by torchair).

    Not torch_npu's ``torch.ops.npu.npu_fused_infer_attention_score``: both convert to the same GE
    op, but torch_npu's takes ``actual_seq_lengths(_kv)`` as a host ``SymInt[]``, while dcpgraph's
    lengths are per-step tensor inputs; turning them into SymInts needs ``aten._local_scalar_dense``,
    which torchair cannot convert (and a list would bake the batch size into the graph). torchair's
    overload (documented as graph-mode only) takes them as int64 device tensors.
    """
    if not _has_op("air", "npu_fused_infer_attention_score"):
        try:  # torchair registers it when this module is imported (lazily, by its ops package)
            import torchair.ops._npu_fused_infer_attention_score  # noqa: F401
        except Exception as err:  # noqa: BLE001 - any failure means the op is unavailable
            raise NpuLoweringError(
                "torch.ops.air.npu_fused_infer_attention_score is not registered: it comes with "
                "torchair (import torch_npu, then torchair, on an Ascend machine with CANN); "
                f"importing it failed: {type(err).__name__}: {err}"
            ) from err
    return torch.ops.air.npu_fused_infer_attention_score.default


def attention_update_op():
    """``torch.ops.npu.npu_attention_update.default`` (registered by libtorch_npu.so)."""
    if not _has_op("npu", "npu_attention_update"):
        raise NpuLoweringError(
            "torch.ops.npu.npu_attention_update is not registered: it comes from torch_npu "
            "(libtorch_npu.so); import torch_npu on an Ascend machine, or lower with merge='aten'"
        )
    return torch.ops.npu.npu_attention_update.default


def _npu_op(name: str):
    if not _has_op("npu", name):
        raise NpuLoweringError(
            f"torch.ops.npu.{name} is not registered: it comes from torch_npu (libtorch_npu.so, "
            "torch-npu 2.13.0 declares it); import torch_npu on an Ascend machine"
        )
    return getattr(torch.ops.npu, name).default


def lightning_indexer_op():
    """``torch.ops.npu.npu_lightning_indexer.default`` (DSA indexer, GE ``LightningIndexer``)."""
    return _npu_op("npu_lightning_indexer")


def sparse_flash_attention_op():
    """``torch.ops.npu.npu_sparse_flash_attention.default`` (GE ``SparseFlashAttention``)."""
    return _npu_op("npu_sparse_flash_attention")


# -- ops torchair 2.13 registers converters for that raise NotImplementedError --------------------
def _amax_as_max(x: torch.Tensor, dim=(), keepdim: bool = False) -> torch.Tensor:
    """``amax`` as repeated ``max.dim`` (GE ``ReduceMax``)."""
    dims = sorted((d % x.dim() for d in (dim or range(x.dim()))), reverse=True)
    for d in dims:
        x = aten.max.dim(x, d, True)[0]
    return x if keepdim else x.squeeze(dims)


def _isnan_as_ne(x: torch.Tensor) -> torch.Tensor:
    """``isnan(x)`` as ``x != x`` (true exactly for NaN)."""
    return aten.ne.Tensor(x, x)


GE_DECOMPOSITIONS = {
    aten.amax.default: _amax_as_max,
    aten.isnan.default: _isnan_as_ne,
}
