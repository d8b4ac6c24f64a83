"""The MLA end-to-end suite's models, run settings and run selection, shared by the tests that reuse them.

``dcpgraph.models.build_model("deepseek_v2" | "deepseek_v3")`` in fp64 with every weight redrawn
at a scale where attention matters (:func:`build`); the selection of ``(model, tp, dcp, interleave,
comm)`` runs and their KV sizing are explained in ``test_e2e_mla``'s docstring.
"""

from __future__ import annotations

import itertools

import torch

from dcpgraph import ConfigError, Mesh
from dcpgraph.models import build_model
from dcpgraph.testing.generation import hf_greedy

__all__ = ["BLOCK_SIZE", "CASES", "COMMS", "EXPECTED_VALID", "HEADS", "INTERLEAVES", "KV_LORA_RANK", "LAYERS",
           "MAX_BATCHED", "MAX_NEW", "MODELS", "MOE_LAYERS", "NOPE", "NUM_BLOCKS", "PROMPTS", "ROPE", "SEEDS",
           "VOCAB", "V_DIM", "build", "case_for", "covering_selection", "hf_greedy", "sizing", "valid_meshes"]

# -- models -------------------------------------------------------------------------------------
MODELS = ("deepseek_v2", "deepseek_v3")
SEEDS = {"deepseek_v2": 1, "deepseek_v3": 1}
VOCAB = 256
LAYERS = 2
HEADS = 8
KV_LORA_RANK, ROPE, NOPE, V_DIM = 32, 8, 16, 16
MOE_LAYERS = (1,)  # first_k_dense_replace=1
EXPECTED_VALID = [(1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (4, 4)]

# -- run settings -------------------------------------------------------------------------------
BLOCK_SIZE = 4
INTERLEAVES = (1, BLOCK_SIZE)
COMMS = ("a2a", "ag_rs")
MAX_BATCHED = 8
MAX_NEW = 20
NUM_BLOCKS = 40  # dcp=1: 160 tokens, enough for the whole batch (1+3+6+19 + 4·20 = 109) at once
PROMPTS = (
    (7,),
    (9, 4, 77),
    tuple(range(10, 16)),
    tuple((7 * i + 3) % VOCAB for i in range(19)),
)


def build(name: str) -> torch.nn.Module:
    """``build_model(name)`` (fp64) with every weight redrawn at a scale where attention matters."""
    model = build_model(name, dtype=torch.float64)
    gen = torch.Generator().manual_seed(SEEDS[name])

    def draw(t: torch.Tensor, mean: float, std: float) -> None:
        t.copy_(mean + std * torch.randn(t.shape, generator=gen, dtype=t.dtype))

    with torch.no_grad():
        for pname, p in model.named_parameters():
            draw(p, 1.0, 0.3) if "norm" in pname else draw(p, 0.0, 0.2)
        for bname, b in model.named_buffers():
            if bname.endswith("e_score_correction_bias"):
                draw(b, 0.0, 0.1)
    return model


def valid_meshes() -> list[tuple[int, int]]:
    valid = []
    for tp, dcp in itertools.product((1, 2, 4), repeat=2):
        try:
            Mesh(tp, dcp).validate(attention="mla", num_q_heads=HEADS, block_size=BLOCK_SIZE)
        except ConfigError:
            continue
        valid.append((tp, dcp))
    return valid


def covering_selection() -> list[tuple[str, int, int, int, str]]:
    """``(model, tp, dcp, interleave, comm)`` runs; see the module docstring."""
    cases = []
    for m_index, name in enumerate(MODELS):
        sharded = 0
        for k, (tp, dcp) in enumerate(valid_meshes()):
            if dcp == 1:
                cases.append((name, tp, dcp, 1, COMMS[(k + m_index) % 2]))
            else:
                phase = m_index + sharded
                cases += [(name, tp, dcp, il, COMMS[(j + phase) % 2]) for j, il in enumerate(INTERLEAVES)]
                sharded += 1
    return cases


CASES = covering_selection()


def sizing(dcp: int, interleave: int) -> dict[str, int]:
    """Equal ``num_blocks`` for dcp=1 and interleave-1 runs; equal token capacity otherwise."""
    if dcp > 1 and interleave == BLOCK_SIZE:
        return {"kv_cache_tokens": NUM_BLOCKS * BLOCK_SIZE}
    return {"num_blocks": NUM_BLOCKS}


def case_for(name: str, tp: int, dcp: int, interleave: int | None = None):
    return next(c for c in CASES if c[:3] == (name, tp, dcp) and interleave in (None, c[3]))
