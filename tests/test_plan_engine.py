"""The planner's capacity figures equal what compiled engines report (one source of truth).

For tiny random HF models (GQA: Llama and Qwen3 with one KV head; MLA: DeepSeek-V2 and V3), traced
once and compiled on the emulator for several meshes and block sizes with a KV budget in bytes per
rank, ``dcpgraph.plan`` (from the model's config alone) must give the engine's
``memory_report()``: bytes per rank, bytes per token, number of blocks, capacity, virtual block.
The planner's per-rank cache shapes must equal the compiled program's ``caches`` too.
"""

from __future__ import annotations

import pytest
import torch

import dcpgraph
from dcpgraph import capacity
from dcpgraph.models import build_model
from dcpgraph.plan import load_model_shape, plan
from dcpgraph.runtime.engine import kv_bytes_per_block

BUDGET = 100_003  # bytes per rank: deliberately not a multiple of any block size
CASES = {
    "llama": [(1, 1), (2, 1), (2, 2), (4, 2), (4, 4)],
    "qwen3": [(2, 2), (8, 4)],
    "deepseek_v2": [(1, 1), (2, 2), (4, 2), (4, 4)],
    "deepseek_v3": [(2, 1), (8, 8)],
}


@pytest.fixture(scope="module")
def programs():
    out = {}
    for arch in CASES:
        model = build_model(arch, dtype=torch.float32)
        out[arch] = (model.config, dcpgraph.trace(model))
    return out


@pytest.mark.parametrize("arch", sorted(CASES))
@pytest.mark.parametrize("block_size", [4, 16])
def test_planner_capacity_equals_memory_report(programs, arch, block_size):
    config, program = programs[arch]
    shape = load_model_shape(config, dtype="float32")
    for tp, dcp in CASES[arch]:
        engine = dcpgraph.compile(program, tp=tp, dcp=dcp, block_size=block_size, backend="eager",
                                  capture_limit=0, verify=False, kv_cache_bytes_per_rank=BUDGET)
        report = engine.memory_report()
        assert capacity.cache_shapes(engine.program.caches) == shape.cache_shapes(tp)
        assert capacity.bytes_per_block(shape.cache_shapes(tp), block_size) == kv_bytes_per_block(engine.program)
        result = plan(shape, world_size=tp, hardware="h200", kv_cache_memory_bytes=BUDGET, block_size=block_size,
                      max_model_len=block_size * dcp)
        row = next(r for r in result.rows if r.tp == tp and r.dcp == dcp and r.valid)
        assert row.num_blocks == report["num_blocks"], (tp, dcp)
        assert row.capacity_tokens == report["kv_capacity_tokens"], (tp, dcp)
        assert row.num_blocks * row.bytes_per_block == report["kv_bytes_per_rank"][0], (tp, dcp)
        assert row.kv_bytes_per_token == report["kv_bytes_per_token"], (tp, dcp)
        assert capacity.tokens_per_block(block_size, dcp) == report["virtual_block_tokens"]


def test_planner_refuses_what_compile_refuses(programs):
    config, program = programs["llama"]  # 8 query heads, 1 KV head
    result = plan(load_model_shape(config, dtype="float32"), world_size=4, hardware="h200", kv_cache_memory_bytes=BUDGET, max_model_len=16)
    for row in result.rows:
        if row.valid:
            continue
        with pytest.raises(dcpgraph.ConfigError) as err:
            dcpgraph.compile(program, tp=row.tp, dcp=row.dcp, backend="eager", capture_limit=0, verify=False,
                             kv_cache_bytes_per_rank=BUDGET)
        assert str(err.value) == row.rule
