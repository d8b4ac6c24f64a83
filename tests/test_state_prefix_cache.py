"""The recurrent-state prefix cache's bookkeeping (:mod:`dcpgraph.runtime.state_prefix_cache`):
a saved row is invisible to lookups until the step carrying its copy is built, rows are reused
least recently used first, and saves and restores come out as (source, destination) row copies
in order. Exactness of hits against HF: tests/test_hybrid_acceptance.py."""

import pytest

from dcpgraph.runtime.state_prefix_cache import StatePrefixCache


def test_a_save_is_visible_after_its_copy_is_taken():
    cache = StatePrefixCache(first_row=8, rows=2)
    cache.save(b"a", slot=1)
    assert cache.lookup(b"a") is None  # its copy has not been shipped yet
    assert cache.take_copies() == [(1, 8)]
    assert cache.lookup(b"a") == 8
    cache.save(b"a", slot=3)  # the same prefix again: already kept, nothing to copy
    assert cache.take_copies() == []


def test_rows_are_reused_least_recently_used_first():
    cache = StatePrefixCache(first_row=4, rows=2)
    cache.save(b"a", 0)
    cache.save(b"b", 1)
    cache.take_copies()
    cache.restore(b"a", 2)  # "a" is now the most recently used
    cache.save(b"c", 3)
    assert cache.take_copies() == [(4, 2), (3, 5)]  # restore first, then c into b's row
    assert cache.lookup(b"b") is None and cache.lookup(b"a") == 4 and cache.lookup(b"c") == 5
    assert cache.stats == {"saved": 3, "restored": 1, "evicted": 1}


def test_no_row_is_taken_from_a_save_in_flight():
    cache = StatePrefixCache(first_row=0, rows=1)
    cache.save(b"a", 5)
    cache.save(b"b", 6)  # the only row is a's, not yet shipped: b is not kept
    assert cache.take_copies() == [(5, 0)] and cache.lookup(b"b") is None
    with pytest.raises(ValueError, match="at least one row"):
        StatePrefixCache(0, 0)
