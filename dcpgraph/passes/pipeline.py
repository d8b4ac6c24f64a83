"""The default pipeline: trace → absorb_mla → insert_kv_cache → select_logits → shard_tp →
shard_dcp → fuse_new_tokens (dcp=1 only)."""

from __future__ import annotations

import torch

from ..mesh import Mesh
from ..program import Program
from .absorb_mla import absorb_mla
from .fuse_new_tokens import fuse_new_tokens
from .insert_kv_cache import insert_kv_cache
from .manager import run_passes
from .select_logits import select_logits
from .shard_dcp import shard_dcp
from .shard_tp import shard_tp


def default_passes(mesh: Mesh, *, block_size: int, comm: str, plan=None):
    return [
        absorb_mla,
        insert_kv_cache.with_options(block_size=block_size),
        select_logits,
        shard_tp.with_options(mesh=mesh, plan=plan),
        shard_dcp.with_options(comm=comm),
        fuse_new_tokens,
    ]


def compile_program(
    model: torch.nn.Module | Program, mesh: Mesh, *, block_size: int = 16, interleave: int = 1,
    comm: str = "auto", plan=None, verify: bool = True,
) -> Program:
    from ..api import trace

    program = model if isinstance(model, Program) else trace(model)
    program = program.replace(options={**program.options, "interleave": interleave})
    return run_passes(program, default_passes(mesh, block_size=block_size, comm=comm, plan=plan), verify=verify)
