"""A DeepSeek-V4 whose every attention layer is compressed (the released layout: no sliding-only
layer), so the program has no dense attention node at all: ``insert_kv_cache`` only adds the step
metadata the compressed caches read, and ``shard_dcp`` lowers the compressed layers without a
dense merge to price. Greedy tokens equal HF ``generate`` at tp1 and at tp2·dcp2 (emulated)."""

from __future__ import annotations

import dsv4_models
import pytest

import dcpgraph
from dcpgraph.passes.insert_compressed_cache import COMPRESSED_CACHE_ROLES
from dcpgraph.testing.generation import hf_greedy

NEW = 4


@pytest.fixture(scope="module")
def compressed_only():
    model = dsv4_models.build(layer_types=["heavily_compressed_attention", "compressed_sparse_attention"],
                              num_hidden_layers=2, mlp_layer_types=["hash_moe", "moe"])
    prompts = [list(p) for p in dsv4_models.PROMPTS]
    return model, prompts, [hf_greedy(model, p, NEW) for p in prompts]


@pytest.mark.parametrize(("tp", "dcp"), [(1, 1), pytest.param(2, 2, marks=pytest.mark.slow)])  # ~12 s a mesh
def test_a_model_without_dense_attention_equals_hf(compressed_only, tp, dcp):
    model, prompts, want = compressed_only
    engine = dcpgraph.compile(model, tp=tp, dcp=dcp, block_size=4, max_num_batched_tokens=5)
    assert engine.generate(prompts, NEW) == want
    roles = {c.role for c in engine.program.caches}
    assert roles and roles <= COMPRESSED_CACHE_ROLES, roles  # no dense KV cache at all
