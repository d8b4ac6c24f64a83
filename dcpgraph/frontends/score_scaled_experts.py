"""MoE blocks whose experts take every token pre-scaled by its router score (Llama-4 text).

Such a block routes no token: the router's top-k logits become sigmoid scores (0 for the experts
not chosen), every expert runs on every token scaled by its score, and the experts' outputs are
summed with the shared expert's:

    s = router(x)                                   # [T, E], exactly 0 off the top-k
    y = shared(x) + Σ_e  down_e( act(gate_e(s_e·x)) · up_e(s_e·x) )

HF writes the expert batch as ``x.repeat(E, 1) · s`` viewed ``[E, T, H]`` and back to ``[E·T, H]``;
``torch.export`` cannot prove the contiguity guard those views raise for a symbolic ``T``
(``T·min(H, H·T) == H·T``) and refuses the dynamic token count. While a model is exported, each
recognised block here runs the same arithmetic on an ``[E, T, H]`` broadcast instead (the same
products, matmuls and sum over experts in the same order: bitwise the same values), with the sum
over experts inside the experts module, so the module's output is ``[T, H]`` and the TP plan's
``moe_tp_experts`` all-reduces ``T·H`` values, merged with the shared expert's all-reduce.

Recognised structurally: a module with a linear ``router`` (``E`` outputs), a ``shared_expert``
and ``experts`` holding ``gate_up_proj [E, H, 2I]`` and ``down_proj [E, I, H]`` (input features
first, HF's layout for these experts) and an ``act_fn``, not one of transformers' routed-experts
modules (those dispatch tokens and export as they are).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator

import torch


def is_score_scaled_moe(module: torch.nn.Module) -> bool:
    router, experts = getattr(module, "router", None), getattr(module, "experts", None)
    if not isinstance(router, torch.nn.Linear) or getattr(module, "shared_expert", None) is None:
        return False
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not (isinstance(gate_up, torch.nn.Parameter) and isinstance(down, torch.nn.Parameter)
            and gate_up.dim() == 3 and down.dim() == 3 and hasattr(experts, "act_fn")):
        return False
    if hasattr(experts, "is_transposed") or hasattr(experts, "has_gate"):  # transformers' routed experts
        return False
    experts_n, hidden = router.out_features, router.in_features
    return (tuple(gate_up.shape) == (experts_n, hidden, 2 * down.shape[1])
            and tuple(down.shape) == (experts_n, down.shape[1], hidden))


def _moe_forward(self, hidden_states: torch.Tensor):
    hidden = self.router.in_features
    x = hidden_states.reshape(-1, hidden)
    scores, logits = self.router(x)
    routed = self.experts(x.unsqueeze(0) * scores.transpose(0, 1).unsqueeze(-1))
    return self.shared_expert(x) + routed, logits


def _experts_forward(self, scaled: torch.Tensor) -> torch.Tensor:
    """``[E, T, H]`` (token ``t`` scaled by its score for expert ``e``) -> ``[T, H]``, summed over experts."""
    gate, up = torch.bmm(scaled, self.gate_up_proj).chunk(2, dim=-1)
    return torch.bmm(up * self.act_fn(gate), self.down_proj).sum(dim=0)


@contextlib.contextmanager
def traceable_score_scaled_experts(model: torch.nn.Module) -> Iterator[int]:
    """Inside the block, every recognised block and its experts run the broadcast form; yields how
    many. The modules' own forwards are restored on exit."""
    found = [m for m in model.modules() if is_score_scaled_moe(m)]
    patched = []
    try:
        for moe in found:
            moe.forward = types.MethodType(_moe_forward, moe)
            moe.experts.forward = types.MethodType(_experts_forward, moe.experts)
            patched += [moe, moe.experts]
        yield len(found)
    finally:
        for module in patched:
            del module.forward
