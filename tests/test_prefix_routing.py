"""Prefix-aware routing over data-parallel replicas (:mod:`dcpgraph.serving.prefix_routing`).

The router is checked against its rule written out by hand (longest recorded prefix within
``balance_slack`` of the least busy replica, else least outstanding), and over two in-process
engines: a request sharing a long prefix with an earlier one goes to that one's replica, reads its
cached blocks there, and its tokens equal one engine's.
"""

from __future__ import annotations

import pytest

import dcpgraph
from dcpgraph.models import build_model
from dcpgraph.serving.data_parallel import DataParallelEngine
from dcpgraph.serving.prefix_routing import PrefixAwareRouter, block_hashes


def test_block_hashes_chain_full_blocks_only():
    assert block_hashes([1, 2, 3], 4) == []
    a, b = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4), block_hashes([1, 2, 3, 4, 0, 6, 7, 8], 4)
    assert len(a) == 2 and a[0] == b[0] and a[1] != b[1]
    # the same block after a different prefix hashes differently (chained, not per block)
    assert block_hashes([0, 0, 0, 0, 5, 6, 7, 8], 4)[1] != a[1]


def test_the_longest_recorded_prefix_wins_within_the_slack():
    router = PrefixAwareRouter(3, block_tokens=2, balance_slack=1)
    shared = [1, 2, 3, 4, 5, 6]
    assert router.choose(shared + [7], [0, 0, 0]) == 0  # nothing recorded: least outstanding, lowest index
    assert router.choose([9, 9, 9], [1, 0, 0]) == 1      # no full block in common with replica 0
    assert router.choose(shared + [8], [1, 1, 0]) == 0   # 3 blocks on replica 0, one request busier: taken
    assert router.prefix_routed == 1
    assert router.choose(shared, [3, 1, 1]) == 1         # replica 0 two busier than the least: balance wins
    # replica 1 now holds the shared prefix too; at equal match the less busy one is taken
    assert router.choose(shared, [2, 1, 0]) == 1
    assert router.matched_blocks(2, block_hashes(shared, 2)) == 0


def test_the_record_is_bounded_least_recently_used_first():
    router = PrefixAwareRouter(1, block_tokens=1, capacity=3)
    router.choose([1, 2, 3], [0])
    router.choose([4], [0])
    assert router.matched_blocks(0, block_hashes([1, 2, 3], 1)) == 0  # its first block was dropped
    assert router.matched_blocks(0, block_hashes([4], 1)) == 1


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="block_tokens >= 1"):
        PrefixAwareRouter(2, block_tokens=0)


def test_replicas_route_a_shared_prefix_to_its_cache():
    def engine():
        return dcpgraph.compile(build_model("llama"), block_size=4, num_blocks=32, enable_prefix_caching=True)

    shared = list(range(3, 23))  # five full 4-token blocks
    prompts = [shared + [1], [30, 31, 32, 33, 34], shared + [2, 5]]
    reference = engine().generate(prompts, 4)
    dp = DataParallelEngine([engine(), engine()], router=PrefixAwareRouter(2, block_tokens=4, balance_slack=1))
    b = dp.add_request(prompts[1], 4)   # nothing recorded: replica 0
    a = dp.add_request(prompts[0], 4)   # least outstanding: replica 1
    tokens = {a: [], b: []}
    for rid, token, _ in dp.step():  # both prefills: replica 1 now caches the shared blocks
        tokens[rid].append(token)
    c = dp.add_request(prompts[2], 4)   # least outstanding says 0; replica 1 holds the prefix, within the slack
    tokens[c] = []
    assert [dp.engine_of(r) for r in (a, b, c)] == [1, 0, 1] and dp.router.prefix_routed == 1
    while any(dp.live(i) for i in range(2)):
        for rid, token, _ in dp.step():
            tokens[rid].append(token)
    assert [tokens[a], tokens[b], tokens[c]] == reference
    assert dp.replicas[1].report()["prefix_cache"]["hit_tokens"] > 0
