"""The per-step caches that keep a long context's host work from growing with it: a request's
joined tokens (``Request.tokens``) and its block-table row tensor (``step_inputs.TableRows``).
Each must give exactly what rebuilding from scratch gives, whatever happened in between."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dcpgraph.mesh import Mesh
from dcpgraph.runtime.sampling import SamplingParams
from dcpgraph.runtime.scheduler import Request
from dcpgraph.runtime.step_inputs import Chunk, TableRows, build_step_inputs


def _request(prompt):
    return Request(id=0, prompt=list(prompt), max_new_tokens=100, params=SamplingParams(temperature=0))


def test_tokens_are_prompt_plus_output_after_appends_and_replacements():
    r = _request([1, 2, 3])
    first = r.tokens
    assert first == [1, 2, 3]
    assert r.tokens is first  # unchanged: the same list, not a copy
    r.output.append(7)
    r.output.append(8)
    assert r.tokens == [1, 2, 3, 7, 8] and r.num_tokens == 5
    r.output = [9]  # replaced (a continuation): rebuilt
    assert r.tokens == [1, 2, 3, 9]
    r.prompt = [4]
    assert r.tokens == [4, 9]
    r.output.pop()  # shrank: rebuilt
    assert r.tokens == [4]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["append", "replace_output", "replace_prompt", "pop", "read"]),
                          st.integers(0, 50)), max_size=40))
def test_tokens_match_a_fresh_join_after_any_sequence_of_changes(changes):
    r = _request([5, 6])
    for op, value in changes:
        if op == "append":
            r.output.append(value)
        elif op == "replace_output":
            r.output = [value] * (value % 4)
        elif op == "replace_prompt":
            r.prompt = [value] * (1 + value % 3)
        elif op == "pop" and r.output:
            r.output.pop()
        assert r.tokens == r.prompt + r.output
        assert r.num_tokens == len(r.prompt) + len(r.output)


def test_table_rows_reuse_unchanged_rows_extend_grown_ones_and_forget_absent_requests():
    rows = TableRows()
    a1, b1 = rows.tables("full", [(1, (4, 5)), (2, (7,))])
    assert a1.tolist() == [4, 5] and b1.tolist() == [7] and a1.dtype == torch.int32
    a2, b2 = rows.tables("full", [(1, (4, 5)), (2, (7, 8, 9))])
    assert a2 is a1  # unchanged: the last step's tensor
    assert b2.tolist() == [7, 8, 9]
    (a3,) = rows.tables("full", [(1, (4, 6))])  # changed, not a growth: converted again
    assert a3.tolist() == [4, 6]
    (b3,) = rows.tables("full", [(2, (7, 8, 9))])  # request 2 was absent from the last step: forgotten
    assert b3 is not b2 and b3.tolist() == [7, 8, 9]
    (s1,) = rows.tables("sliding", [(2, (1,))])  # another table kind: its own rows
    assert s1.tolist() == [1]
    (b4,) = rows.tables("full", [(2, (7, 8, 9))])
    assert b4 is b3


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 6)), min_size=1, max_size=3), min_size=1,
                max_size=8))
def test_step_inputs_with_kept_rows_equal_fresh_ones(steps):
    """Step after step, with request tables that grow, shrink, change or vanish, the inputs built
    with the kept rows equal the ones built from scratch."""
    mesh, rows, tables = Mesh(tp=1, dcp=2), TableRows(), {}
    for step in steps:
        chunks = []
        for request_id, change in dict(step).items():  # one chunk per request
            table = tables.get(request_id, [])
            if change < 3:
                table = table + list(range(10 + change, 12 + change))
            elif change == 3 and table:
                table = table[:-1]
            elif change == 4:
                table = [20 + change] + table[1:]
            table = table or [0]
            tables[request_id] = table
            start = max(0, len(table) * 4 - 2)
            chunks.append(Chunk(request_id, (1,), start, tuple(table)))
        kept = build_step_inputs(chunks, mesh, 4, 1, rows)
        fresh = build_step_inputs(chunks, mesh, 4, 1)
        for k in fresh[0]:
            assert torch.equal(kept[0][k], fresh[0][k]), k
        for mine, theirs in zip(kept[1], fresh[1]):
            for k in theirs:
                assert torch.equal(mine[k], theirs[k]), k


def test_frozen_table_is_one_tuple_until_the_table_changes():
    from dcpgraph.runtime.blocks import BlockManager

    blocks = BlockManager(num_blocks=8, tokens_per_block=4)
    blocks.allocate(1, 6)
    first = blocks.frozen_table(1)
    assert first == tuple(blocks.table(1)) and len(first) == 2
    assert blocks.grow(1, 8) and blocks.frozen_table(1) is first  # same two blocks: not copied again
    assert blocks.grow(1, 9)
    grown = blocks.frozen_table(1)
    assert grown == tuple(blocks.table(1)) and len(grown) == 3 and grown[:2] == first
    blocks.release(1)
    blocks.allocate(1, 3)  # the id again, a new table
    assert blocks.frozen_table(1) == tuple(blocks.table(1)) and len(blocks.frozen_table(1)) == 1


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["grow", "trim", "release", "read"]), st.integers(1, 12)), max_size=30))
def test_frozen_sliding_table_equals_the_table_and_is_kept_until_it_changes(ops):
    """A hybrid model's sliding table, frozen, always equals the live one; between changes it is
    the same tuple (no copy a decode step), after a trim that nulled a block or a growth it is new."""
    from dcpgraph.runtime.layer_groups import HybridBlockManager

    blocks = HybridBlockManager(num_blocks=64, sliding_blocks=32, tokens_per_block=4, window=5)
    tokens = 3
    blocks.allocate(1, tokens)
    last = blocks.frozen_group_table(1)
    for op, n in ops:
        before = list(blocks.group_table(1))
        if op == "grow" and blocks.grow(1, tokens + n):
            tokens += n
        elif op == "trim":
            blocks.trim(1, tokens)
        elif op == "release":
            blocks.release(1)
            tokens = n
            blocks.allocate(1, tokens)
            before = None
        frozen = blocks.frozen_group_table(1)
        assert frozen == tuple(blocks.group_table(1))
        if before is not None and before == blocks.group_table(1):
            assert frozen is last  # unchanged: not copied again
        last = frozen


def test_a_plain_block_manager_has_no_sliding_table():
    from dcpgraph.runtime.blocks import BlockManager

    blocks = BlockManager(num_blocks=4, tokens_per_block=4)
    blocks.allocate(1, 3)
    assert blocks.frozen_group_table(1) is None and blocks.group_table(1) is None


def test_int32_row_converts_any_row_and_refuses_entries_outside_int32():
    import pytest

    from dcpgraph.runtime.step_inputs import int32_row

    assert int32_row(()).dtype == torch.int32 and int32_row(()).numel() == 0
    row = tuple(range(0, 3000, 7)) + (2**31 - 1,)
    assert torch.equal(int32_row(row), torch.tensor(row, dtype=torch.int32))
    with pytest.raises(OverflowError):
        int32_row((2**31,))
