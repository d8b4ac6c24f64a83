"""``dcpgraph plan`` for gated-delta-net hybrids: only the attention layers have KV, each request's
recurrent state comes out of the per-rank budget, and both agree with a compiled engine's
``memory_report()``; other recurrent kinds are refused by name."""

from __future__ import annotations

import pytest
import transformers
from hybrid_models import bamba, qwen3_5

import dcpgraph
from dcpgraph.errors import UnsupportedModelError
from dcpgraph.kv_budget import kv_bytes_per_block
from dcpgraph.plan import load_model_shape, plan
from dcpgraph.plan.planner import fitting_sequences


def test_qwen3_5_shape_counts_attention_layers_and_state():
    shape = load_model_shape({**transformers.Qwen3_5TextConfig().to_dict(), "torch_dtype": "bfloat16"})
    assert (shape.recurrent_layers, shape.attention_layers) == (24, 8)
    assert len(shape.cache_shapes(4)) == 2 * 8  # K and V of the 8 full-attention layers only
    # Hk=16, Hv=32, Dk=Dv=128, K=4 at tp=4, bf16, by hand: conv 3·(2·4·128 + 8·128)·2, state 8·128·128·4
    assert shape.recurrent_state_bytes_per_request(4) == 24 * (3 * (2 * 4 * 128 + 8 * 128) * 2 + 8 * 128 * 128 * 4)
    assert shape.recurrent_state_bytes_per_request(32) == 4 * shape.recurrent_state_bytes_per_request(4)  # 32 ∤ 16: whole


def test_fitting_sequences_takes_the_state_out_of_the_budget():
    # 16-token requests in blocks of 4 (4 blocks each) of 100 B: N fit while 50·N + 400·N <= budget
    assert fitting_sequences(1700, 100, 0, 16, 4, 1) == 4
    assert fitting_sequences(1700, 100, 50, 16, 4, 1) == 3
    assert fitting_sequences(449, 100, 50, 16, 4, 1) == 0


@pytest.mark.slow  # compiles a tp2·dcp2 hybrid (15-140 s on 2 shared cores)
def test_plan_agrees_with_a_compiled_engines_memory_report():
    model = qwen3_5()
    engine = dcpgraph.compile(dcpgraph.trace(model), tp=2, dcp=2, block_size=4, num_blocks=8, max_num_seqs=3,
                              capture_limit=0)
    report = engine.memory_report()
    p = plan({**model.config.to_dict(), "torch_dtype": "float32"}, world_size=2, kv_cache_memory_bytes=1 << 20, block_size=4, max_model_len=64,
             context_len=32, hardware="h200")
    row = next(r for r in p.rows if (r.tp, r.dcp, r.interleave) == (2, 2, 1) and r.valid)
    assert row.state_bytes_per_request == report["recurrent_state_bytes_per_request"] > 0
    assert row.bytes_per_block == kv_bytes_per_block(engine.program)
    assert row.max_concurrency == fitting_sequences(1 << 20, row.bytes_per_block, row.state_bytes_per_request, 32, 4, 2)
    assert any("gated delta net" in a for a in p.assumptions)


def test_other_recurrent_kinds_are_refused_by_name():
    with pytest.raises(UnsupportedModelError, match="bamba.*memory_report"):
        load_model_shape(bamba().config.to_dict())
