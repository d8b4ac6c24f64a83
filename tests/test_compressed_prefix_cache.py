"""DeepSeek-V4 with prefix caching (emulated, dcp=1, tp 1 and 2 over four output groups; tp2·dcp2
in ``test_compressed_pd``): a later request hits the earlier one's cached blocks, whose compressed entries and indexer keys lie in the
paged caches, and the compressors' open windows kept at the hit's last block boundary (the
recurrent-state prefix rows of :mod:`dcpgraph.runtime.state_prefix_cache`; for CSA with the carried
half of the last closed window) are restored into its slot. Greedy tokens equal HF ``generate``."""

from __future__ import annotations

import dsv4_models
import pytest

import dcpgraph
from dcpgraph.errors import UnsupportedModelError

BLOCK = 4  # a multiple of both compress rates (2 and 4): every block boundary is an entry boundary
NEW_TOKENS = 8
BASE = list(dsv4_models.PROMPTS[3])  # 23 tokens
PROMPTS = [BASE, BASE[:18] + [3, 99, 41, 8], BASE[:13] + [77, 2]]


@pytest.fixture(scope="module")
def traced():
    return dsv4_models.traced(o_groups=4)  # shared with test_compile_compressed(_dcp) and test_compressed_pd


@pytest.mark.slow  # the shared V4 export (~30 s, once per process) and ~15 s per engine run on 2 loaded cores
@pytest.mark.parametrize("tp", [1, 2])
def test_prefix_hits_restore_open_windows_and_give_hf_tokens(traced, tp):
    from dcpgraph.testing.generation import drain, hf_greedy

    model, program = traced
    want = [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]
    engine = dcpgraph.compile(program, tp=tp, block_size=BLOCK, max_num_batched_tokens=8, num_blocks=40,
                              enable_prefix_caching=True)
    got = {0: engine.generate([PROMPTS[0]], NEW_TOKENS)[0]}
    for prompt in PROMPTS[1:]:
        engine.add_request(prompt, max_new_tokens=NEW_TOKENS)
    got.update(drain(engine))
    assert [got[i] for i in range(len(PROMPTS))] == want
    report = engine.prefix_cache_report()
    assert report["hit_requests"] == 2 and report["hit_tokens"] == 16 + 8  # cut to blocks with a kept window
    assert engine.scheduler.state_prefix.stats["restored"] == 2


def test_prefix_caching_with_a_block_that_is_no_entry_boundary_is_refused_by_name():
    with pytest.raises(UnsupportedModelError, match=r"enable_prefix_caching=True with block_size·dcp=6 is not a "
                       r"multiple of lcm of the compress rates \[2, 4\] = 4 \(valid block_size: multiples of 4\)"):
        dcpgraph.compile(dsv4_models.build(), block_size=6, enable_prefix_caching=True)


def test_prefix_caching_at_dcp2_with_entry_blocks_wider_than_their_tokens_is_refused_by_name():
    """At dcp=2 with interleave 2 and blocks of 4, rate 4's entries go in runs of 2 per rank: an entry
    block of a rank spans 8 tokens' entries, so a later entry would land in a cached block
    (``test_compressed_pd`` runs the exact setting, blocks of 8)."""
    with pytest.raises(UnsupportedModelError, match=r"enable_prefix_caching=True with block_size=4 at dcp=2 with "
                       r"interleave=2: each compress rate m in \[2, 4\] must divide block_size and interleave must "
                       r"divide block_size // m.*\(valid block_size: multiples of interleave·lcm = 8\)"):
        dcpgraph.compile(dsv4_models.build(), tp=2, dcp=2, block_size=4, interleave=2, enable_prefix_caching=True)
