"""Speculative decoding with DeepSeek-V4's compressed layers: prompt-lookup (ngram) drafts, some
kept and some rejected, give HF ``generate``'s greedy tokens on the tiny model of
``tests/dsv4_models.py`` (fp64) at tp=1 and tp=2·dcp=2 (emulated ranks), with 8-token prefill
chunks sharing steps with verification rows.

The open windows are recurrent state, restored and replayed past rejected drafts
(:mod:`dcpgraph.runtime.state_rollback`). The compressed ops write their raw rows and entries by
block table and position, not by ``slot_mapping``, so the padding rows of a static-shape
verification step (zero table entries, :mod:`dcpgraph.runtime.verify_buckets`) would write into
block 0: a V4 engine keeps block 0 as a scratch block no request is given
(:class:`~dcpgraph.runtime.blocks.BlockManager` ``scratch_block``). Without it the request holding
block 0 leaves HF's tokens here."""

from __future__ import annotations

import dsv4_models
import pytest

import dcpgraph
from dcpgraph.runtime.blocks import BlockManager

# Their greedy tokens repeat (drafts kept); three rows pad a verification step to the bucket of 4, whose padding
# row writes into block 0, the first prompt's first block without the scratch block.
PROMPTS = [[9], [12, 12, 12], [50]]
NEW_TOKENS = 10  # token 1 is the engine's EOS (HF's generate here has none): every run stays short of it
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}


def test_a_scratch_block_is_never_handed_out():
    """Block 0 stays out of every table; the capacity is still ``num_blocks`` blocks, the caches
    hold one more."""
    blocks = BlockManager(3, 4, scratch_block=True)
    assert blocks.cache_blocks == 4 and blocks.free_blocks == 3 and blocks.capacity_tokens == 12
    assert sorted(blocks.allocate(0, 12)) == [1, 2, 3]
    assert not blocks.can_allocate(1)
    blocks.release(0)
    assert blocks.free_blocks == 3 and sorted(blocks.allocate(1, 9)) == [1, 2, 3]
    plain = BlockManager(3, 4)
    assert plain.cache_blocks == 3 and sorted(plain.allocate(0, 12)) == [0, 1, 2]


@pytest.fixture(scope="module")
def traced_four_groups():
    return dsv4_models.traced(o_groups=4)  # shared with test_compile_compressed(_dcp)


@pytest.mark.slow  # the shared V4 export (~25 s once per process); the runs take ~10 s (tp1) and ~25 s (tp2·dcp2)
@pytest.mark.parametrize("mesh", [{}, {"tp": 2, "dcp": 2}], ids=["tp1", "tp2dcp2"])
def test_ngram_speculation_on_v4_gives_hf_greedy_tokens(traced_four_groups, mesh):
    from dcpgraph.testing.generation import hf_greedy

    model, program = traced_four_groups
    want = [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]
    engine = dcpgraph.compile(program, block_size=4, max_num_batched_tokens=8, speculative_config=NGRAM, **mesh)
    assert engine.generate(PROMPTS, NEW_TOKENS) == want
    stats = engine.speculative_report()
    assert 0 < stats["accepted"] < stats["drafted"], stats  # drafts both kept and rejected
    assert stats["state_replays"]["rows"] > 0  # the open windows were rolled back
    assert any(name.startswith("verify[") for name in engine.report()["graph_steps"])  # padded verify steps


@pytest.mark.slow  # the shared V4 export (~25 s once per process, reused); the compile takes a few seconds
def test_the_scratch_block_is_counted_in_memory_and_paid_from_a_byte_budget(traced_four_groups):
    """A byte budget of ``k`` blocks gives requests ``k − 1`` (the scratch block is paid from the
    same bytes), and ``memory_report`` counts the bytes the caches hold, the scratch block included."""
    from dcpgraph.kv_budget import kv_bytes_per_block

    _, program = traced_four_groups
    sized = dcpgraph.compile(program, block_size=4, num_blocks=2)
    per_block = kv_bytes_per_block(sized.program)
    engine = dcpgraph.compile(program, block_size=4, kv_cache_bytes_per_rank=5 * per_block)
    report = engine.memory_report()
    assert report["num_blocks"] == 4 and report["scratch_blocks"] == 1
    assert report["kv_bytes_per_rank"] == [5 * per_block]
    assert report["kv_capacity_tokens"] == 4 * 4
