"""``kv_cache_write_`` → aten ``scatter_`` (GE ``ScatterElements``)."""

from __future__ import annotations

import torch

from .rules import Site, register


def _row_shape(site: Site) -> dict:
    cache = site.args[0]
    return {"row_shape": tuple(int(d) for d in cache.shape[2:])}


def _not_fp8(site: Site) -> str | None:
    if site.args[0].dtype == torch.float8_e4m3fn:
        return "an fp8 cache is written by kv_cache_write_fp8_ (quantise + scales), which has no Ascend lowering"
    return None


# kv_cache_write_fp8_ deliberately has no rule: lower_npu then refuses the graph, naming the op.
@register(torch.ops.dcpgraph.kv_cache_write_.default, "kv_cache_write_->scatter_", checker=_not_fp8,
          params=_row_shape)
def kv_cache_write_as_scatter(cache: torch.Tensor, new: torch.Tensor, slot_mapping: torch.Tensor, *,
                              row_shape: tuple[int, ...]) -> None:
    """Write ``new[t]`` into slot ``slot_mapping[t]`` of the cache ``[NB, B, *row_shape]``.

    ``scatter_`` along dim 0 of the cache viewed ``[NB·B, *row_shape]``, the slot index broadcast
    over the row (torchair has no ``index_put`` converter). Slot −1 (a token this DCP rank does
    not own) must not write: such tokens are pointed at the first owned token's slot with that
    token's value (or, when no token is owned, at slot 0 with slot 0's current value), so every
    write to a slot carries the same value and the result does not depend on scatter order.
    Assumes a step has at least one token (every dcpgraph step does).

    Not used: torchair's ``npu_scatter_pa_kv_cache`` converter (its handling of slot −1 is
    unchecked). The write goes to a graph input, which AOT autograd functionalises (torchair keeps
    input mutations in the graph by default), not a dedicated scatter-to-cache kernel.
    """
    rows = cache.view(-1, *row_shape)
    slots = slot_mapping.to(torch.int64)
    owned = slots >= 0
    first = owned.to(torch.int32).argmax(0).view(1)  # the first owned token (0 if none)
    any_owned = owned.index_select(0, first)  # [1]
    spare_slot = torch.where(any_owned, slots.index_select(0, first), 0)
    index = torch.where(owned, slots, spare_slot)  # [T]
    values = new.to(cache.dtype)
    per_row = (-1,) + (1,) * len(row_shape)
    spare_value = torch.where(any_owned.view(per_row), values.index_select(0, first),
                              rows.index_select(0, spare_slot))
    values = torch.where(owned.view(per_row), values, spare_value)
    rows.scatter_(0, index.view(per_row).expand(-1, *row_shape), values)
