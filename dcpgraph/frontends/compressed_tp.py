"""DeepSeek-V4's attention split over TP ranks, as vLLM splits shared-KV MQA.

V4's attention has one K=V head shared by all query heads, so the query heads are split and the
single head is replicated (every rank keeps the whole raw window, entries and open windows, as
MLA at ``tp > 1``). Per attention module (sliding-only and compressed alike):

- ``q_b_proj`` column-parallel (its rows are ``heads × head_dim``, head-major), ``sinks``
  split with the query heads;
- the grouped output projection split by groups: ``o_a_proj``'s weight ``[G·d_g, H·D/G]`` holds
  group ``g``'s block in rows ``[g·d_g, (g+1)·d_g)``, so its rows split in ``tp`` contiguous
  parts give rank ``r`` groups ``[r·G/tp, (r+1)·G/tp)``, exactly the groups its contiguous query
  heads ``[r·H/tp, (r+1)·H/tp)`` feed; ``o_b_proj`` is row-parallel over the ``G·d_g`` group
  outputs (all-reduce). ``tp`` must divide ``G`` (``o_groups``);
- a sliding-only layer's ``kv_proj`` colwise in one part (the K/V projection of a one-head
  cache: replicated); a compressed layer's ``kv_proj``, compressor and CSA indexer stay
  unplanned (replicated: they compute the one shared head's entries and the selection every
  rank needs whole).

The grouped projection is traced by :func:`grouped_output_forward`, which takes the group count
from the local weight, so the same graph is exact with ``G/tp`` local groups.
"""

from __future__ import annotations

import torch

V4_ATTENTION_PARTS = ("q_b_proj", "o_a_proj", "o_b_proj", "kv_proj", "sinks", "compressor")


def is_v4_attention(module: torch.nn.Module) -> bool:
    """A V4 attention (sliding-only or compressed): query LoRA, one K=V projection, per-head
    sinks and a grouped output projection with ``n_groups``."""
    return (all(hasattr(module, n) for n in V4_ATTENTION_PARTS)
            and hasattr(getattr(module, "o_a_proj", None), "n_groups"))


def grouped_output_forward(self, x: torch.Tensor) -> torch.Tensor:
    """``o_a_proj`` on ``x [..., g, k]`` (any split of each token's ``G'·in_g`` head outputs):
    ``y[..., j, :] = W_j · x_j`` for the ``G' = rows(W) / d_g`` groups of ``in_g`` inputs held by
    the (local) weight ``W [G'·d_g, in_g]``, ``d_g = out_features / n_groups`` → ``[..., G', d_g]``.
    The token's outputs are flattened first and regrouped with ``-1`` groups, so no traced shape
    literal names a group count or a size TP shrinks."""
    d_g = self.out_features // self.n_groups
    flat = x.reshape(*x.shape[:-2], -1)
    groups = flat.view(*flat.shape[:-1], -1, self.in_features)
    return torch.einsum("...gi,goi->...go", groups, self.weight.view(-1, d_g, self.in_features))


def v4_attention_tp_plan(model: torch.nn.Module) -> dict[str, str]:
    """The plan entries (full parameter paths) of every V4 attention module of ``model``; empty
    for other models."""
    plan: dict[str, str] = {}
    for name, module in model.named_modules():
        if not is_v4_attention(module):
            continue
        plan[f"{name}.q_b_proj"] = "colwise"
        plan[f"{name}.sinks"] = "colwise"
        plan[f"{name}.o_a_proj.weight"] = "colwise"
        plan[f"{name}.o_b_proj"] = "rowwise"
        if module.compressor is None:
            plan[f"{name}.kv_proj"] = "colwise"
    return plan


def output_groups(model) -> int | None:
    """The group count ``G`` of V4's grouped output projection: from an ``nn.Module``'s attention
    modules, or a traced Program's facts; None for other models."""
    if isinstance(model, torch.nn.Module):
        return next((int(m.o_a_proj.n_groups) for m in model.modules() if is_v4_attention(m)), None)
    facts = getattr(model, "facts", None)
    return None if facts is None else facts.extra.get("o_groups")
