"""DeepSeek-V4's compressed caches at ``kv_cache_dtype="fp8_e4m3"``: packed rows, values then scales.

Default tier: a packed row (:mod:`dcpgraph.ops.fp8_rows`) is ``D + 4·ceil(D/128)`` bytes and
unpacks to what the scale scheme of :mod:`dcpgraph.ops.quant` promises: exactly the values e4m3
holds after their group's power-of-two scale, within e4m3's relative step (2^-4) otherwise.

Slow tier (the V4 export, ~20 s): the tiny V4 of ``tests/dsv4_models.py`` compiled with fp8 caches
(its sliding layer through the GQA fp8 path, its compressed layers through packed rows), teacher
forced over 32 tokens one step each: every compressed cache is uint8 of the packed width, and its
bytes per token are the planner's (scales included); tp2·dcp2
gives tp1's logits (a row is quantised on its own, so where it lives cannot matter); and against
the model-dtype caches the logits move by fp8's rounding, not more (a lost or misplaced scale moves
them by orders of magnitude).
"""

from __future__ import annotations

from fractions import Fraction

import dsv4_models
import pytest
import torch

import dcpgraph
from dcpgraph.ops.fp8_rows import pack_rows, packed_width, unpack_rows, unpacked_dim
from dcpgraph.plan.compressed_cache import compressed_cache_bytes
from dcpgraph.testing.generation import teacher_forced_logits


@pytest.mark.parametrize("dim", [16, 32, 128, 129, 512, 576])
def test_a_packed_row_holds_its_scales_and_unpacks_within_e4m3(dim):
    assert unpacked_dim(packed_width(dim)) == dim
    assert packed_width(dim) == dim + 4 * -(-dim // 128)
    g = torch.Generator().manual_seed(dim)
    rows = (3 * torch.randn(5, 1, dim, generator=g, dtype=torch.float64)) * torch.logspace(-3, 3, 5).view(5, 1, 1)
    packed = pack_rows(rows)
    assert packed.dtype == torch.uint8 and packed.shape == (5, 1, packed_width(dim))
    back = unpack_rows(packed, torch.float64)
    assert back.shape == rows.shape
    torch.testing.assert_close(back, rows, rtol=2.0 ** -4, atol=0)  # e4m3: 3 mantissa bits, round to nearest
    assert torch.equal(unpack_rows(pack_rows(back), torch.float64), back)  # representable values are exact


@pytest.fixture(scope="module")
def traced():
    model = dsv4_models.build()
    return model, dcpgraph.trace(model)


@pytest.mark.slow  # the V4 export (~20 s) and three 32-step teacher-forced runs (~25 s) on 2 loaded cores
def test_fp8_v4_caches_are_packed_layout_invariant_and_close(traced):
    _, program = traced
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(3, dsv4_models.VOCAB, (32,), generator=g).tolist()

    def run(kv: str, tp: int = 1, dcp: int = 1):
        engine = dcpgraph.compile(program, tp=tp, dcp=dcp, block_size=4, max_num_batched_tokens=1, num_blocks=24,
                                  kv_cache_dtype=kv)
        return teacher_forced_logits(engine, tokens), engine

    fp8, engine = run("fp8_e4m3")
    compressed = {c.name: (c.dim, c.dtype) for c in engine.program.caches if c.role.startswith("compressed")}
    assert compressed and all(dtype == torch.uint8 for _, dtype in compressed.values())
    assert {name: dim for name, (dim, _) in compressed.items()} == {
        name: packed_width(32 if not name.startswith("index") else 16) for name in compressed}
    # the engine's bytes per token are the planner's with the scales counted (module docstring of
    # dcpgraph.plan.compressed_cache): entries and indexer keys beyond one raw row per token
    config = traced[0].config
    by_layer = engine.memory_report()["kv_bytes_per_block_by_layer"]
    layers = sorted({c.layer for c in engine.program.caches if c.role.startswith("compressed")})
    raw = len(layers) * 4 * packed_width(config.head_dim)
    per_token = compressed_cache_bytes(config, context_tokens=64, element_bytes=1, fp8_scales=True).per_token
    assert Fraction(sum(by_layer[i] for i in layers) - raw, 4) == per_token
    sharded, _ = run("fp8_e4m3", tp=2, dcp=2)
    torch.testing.assert_close(sharded, fp8, rtol=1e-9, atol=1e-9)
    auto, _ = run("auto")
    error = (fp8 - auto).abs()
    assert 0 < error.mean() < 0.5 and error.max() < 5, (error.mean(), error.max())
