"""Property tests of the DCP KV layout (``dcpgraph.layout``; docs/architecture.md, KV layout).

Hypothesis draws configurations (dcp 1..16, interleave in {1, 2, 4, 8, 16, 128}, lengths up to
10**5, block sizes, request counts) and seeds; every tensor is built from those with ``torch``
vector ops, never element by element.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, note
from hypothesis import strategies as st

from dcpgraph import layout
from dcpgraph.errors import ConfigError
from dcpgraph.testing import strategies as dst

MAX_L = dst.MAX_LENGTH


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """The tensors here are at most ~10**6 elements: one intra-op thread is fast, and it avoids
    OpenMP spin-waiting, which makes these tests 10-30x slower on a small, busy CI machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@given(data=st.data(), dcp=dst.dcp_sizes(), interleave=dst.interleaves(), cap=st.integers(0, MAX_L))
def test_lengths_strategy_stays_in_range(data, dcp, interleave, cap):
    assert 0 <= data.draw(dst.lengths(dcp, interleave, max_value=cap)) <= cap
    assert 0 <= data.draw(dst.lengths(max_value=cap)) <= cap
    assert block_size_ok(data.draw(dst.block_sizes(interleave)), interleave)


def block_size_ok(block_size: int, interleave: int) -> bool:
    return block_size >= interleave and block_size % interleave == 0


# -- (a) global_index inverts (owner, local_index) ------------------------------------------------
@given(
    dcp=dst.dcp_sizes(),
    interleave=dst.interleaves(),
    start=st.integers(0, MAX_L) | st.sampled_from([2**31 - 7, 2**40 + 3]),
    count=st.integers(0, MAX_L),
)
@example(dcp=16, interleave=128, start=0, count=MAX_L)
@example(dcp=7, interleave=1, start=2**40 + 3, count=MAX_L)
def test_global_index_inverts_owner_and_local_index(dcp, interleave, start, count):
    t = torch.arange(start, start + count)
    r = layout.owner(t, dcp, interleave)
    j = layout.local_index(t, dcp, interleave)
    assert r.dtype == j.dtype == torch.int64
    if count:
        assert int(r.min()) >= 0 and int(r.max()) < dcp
        assert int(j.min()) >= 0
    assert torch.equal(layout.global_index(j, r, dcp, interleave), t)


@given(dcp=dst.dcp_sizes(), interleave=dst.interleaves(), count=st.integers(0, MAX_L // 16))
def test_owner_and_local_index_invert_global_index(dcp, interleave, count):
    """The other direction: every (local index, rank) pair is a distinct global token."""
    j = torch.arange(count).repeat(dcp)
    r = torch.arange(dcp).repeat_interleave(count)
    t = layout.global_index(j, r, dcp, interleave)
    assert torch.equal(layout.owner(t, dcp, interleave), r)
    assert torch.equal(layout.local_index(t, dcp, interleave), j)
    assert t.unique().numel() == t.numel()


# -- (b) each rank's share of a prefix is a prefix of its local stream ----------------------------
@given(layout_cfg=dst.layouts())
@example(layout_cfg=(16, 128, MAX_L))
@example(layout_cfg=(13, 8, MAX_L - 1))
def test_prefix_of_positions_is_prefix_of_each_local_stream(layout_cfg):
    dcp, interleave, length = layout_cfg
    t = torch.arange(length)
    r = layout.owner(t, dcp, interleave)
    j = layout.local_index(t, dcp, interleave)
    for rank in range(dcp):
        mine = j[r == rank]  # in increasing global order
        n = layout.local_len(length, rank, dcp, interleave)
        assert torch.equal(mine, torch.arange(n)), f"rank {rank}"


# -- (c) local_len against a naive count ----------------------------------------------------------
@given(layout_cfg=dst.layouts())
@example(layout_cfg=(16, 128, MAX_L))
@example(layout_cfg=(11, 4, 10**5 - 10**5 % 44 + 3))
@example(layout_cfg=(2, 4, 1))  # max_local_len is 1 here, not ceil(1 / 8) * 4
def test_local_len_matches_bincount_and_sums_to_length(layout_cfg):
    dcp, interleave, length = layout_cfg
    naive = torch.bincount(layout.owner(torch.arange(length), dcp, interleave), minlength=dcp)
    per_rank = [layout.local_len(length, rank, dcp, interleave) for rank in range(dcp)]
    assert per_rank == naive.tolist()
    assert sum(per_rank) == length
    as_tensor = layout.local_len(torch.tensor(length), torch.arange(dcp), dcp, interleave)
    assert torch.equal(as_tensor, naive)
    assert layout.max_local_len(length, dcp, interleave) == max(per_rank)
    # The closed form max_local_len's docstring states.
    rounds, rest = divmod(length, dcp * interleave)
    assert layout.max_local_len(length, dcp, interleave) == rounds * interleave + min(rest, interleave)
    # Shares differ by at most one interleave run.
    assert max(per_rank) - min(per_rank) <= interleave


@given(layout_cfg=dst.layouts(max_length=20_000))
def test_local_len_of_every_prefix_is_a_running_count(layout_cfg):
    """local_len(L, r) for all L in [0, length] at once (tensor lengths) vs a cumulative count;
    and the causal bound of the query at position p is local_index(p) + 1 on its owner."""
    dcp, interleave, length = layout_cfg
    t = torch.arange(length)
    owners = layout.owner(t, dcp, interleave)
    all_lengths = torch.arange(length + 1)
    for rank in range(dcp):
        running = torch.cat([torch.zeros(1, dtype=torch.int64), (owners == rank).cumsum(0)])
        assert torch.equal(layout.local_len(all_lengths, rank, dcp, interleave), running)
    causal = layout.local_len(t + 1, owners, dcp, interleave)
    assert torch.equal(causal, layout.local_index(t, dcp, interleave) + 1)


# -- (d) int and tensor inputs agree --------------------------------------------------------------
@given(
    dcp=dst.dcp_sizes(),
    interleave=dst.interleaves(),
    values=st.lists(st.integers(0, 10**9), min_size=1, max_size=8),
    ranks=st.lists(st.integers(0, 15), min_size=1, max_size=8),
)
def test_int_and_tensor_inputs_agree(dcp, interleave, values, ranks):
    ranks = [r % dcp for r in ranks]
    n = min(len(values), len(ranks))
    values, ranks = values[:n], ranks[:n]
    vt, rt = torch.tensor(values), torch.tensor(ranks)
    one_arg = (layout.owner, layout.local_index, layout.max_local_len)
    for fn in one_arg:
        ints = [fn(v, dcp, interleave) for v in values]
        assert all(type(x) is int for x in ints), fn.__name__
        assert fn(vt, dcp, interleave).tolist() == ints, fn.__name__
        assert [fn(torch.tensor(v), dcp, interleave).item() for v in values] == ints, fn.__name__
    for fn in (layout.global_index, layout.local_len):
        ints = [fn(v, r, dcp, interleave) for v, r in zip(values, ranks)]
        assert all(type(x) is int for x in ints), fn.__name__
        assert fn(vt, rt, dcp, interleave).tolist() == ints, fn.__name__
        # mixed: tensor first argument with int rank, and int first argument with tensor rank
        assert [fn(torch.tensor(v), r, dcp, interleave).item() for v, r in zip(values, ranks)] == ints
        assert [fn(v, torch.tensor(r), dcp, interleave).item() for v, r in zip(values, ranks)] == ints


def test_default_interleave_is_one():
    t = torch.arange(50)
    assert torch.equal(layout.owner(t, 4), t % 4)
    assert torch.equal(layout.local_index(t, 4), t // 4)
    assert [layout.local_len(10, r, 4) for r in range(4)] == [3, 3, 2, 2]


def test_worked_example_dcp2_interleave2():
    # tokens 0 1 | 2 3 | 4 5 | 6 7 | 8  -> ranks 0 0 1 1 0 0 1 1 0
    t = torch.arange(9)
    assert layout.owner(t, 2, 2).tolist() == [0, 0, 1, 1, 0, 0, 1, 1, 0]
    assert layout.local_index(t, 2, 2).tolist() == [0, 1, 0, 1, 2, 3, 2, 3, 4]
    assert [layout.local_len(9, r, 2, 2) for r in range(2)] == [5, 4]


@pytest.mark.parametrize("fn", [layout.owner, layout.local_index, layout.max_local_len])
@pytest.mark.parametrize("dcp, interleave", [(0, 1), (-2, 1), (2, 0), (2, -4), (2.0, 1), (2, 1.0)])
def test_bad_dcp_or_interleave_raises_config_error(fn, dcp, interleave):
    with pytest.raises(ConfigError):
        fn(3, dcp, interleave)


# -- (e) slot mapping of the paged cache ----------------------------------------------------------
def _block_table(seed: int, context_lens: list[int], virtual: int, spare: int) -> torch.Tensor:
    """One row per request of distinct physical block ids (a random permutation of a pool with
    ``spare`` unused blocks), padded with -1 where a request needs fewer blocks."""
    needed = [-(-n // virtual) for n in context_lens]
    width = max(max(needed), 1)
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randperm(sum(needed) + spare, generator=gen)
    table = torch.full((len(context_lens), width), -1, dtype=torch.int64)
    start = 0
    for i, n in enumerate(needed):
        table[i, :n] = pool[start : start + n]
        start += n
    return table


@st.composite
def paged_configs(draw, max_length=MAX_L, budget=10**6):
    """(dcp, interleave, block_size, context lengths); tokens x ranks stays within ``budget``
    (each rank maps every token), so dcp=1 reaches 10**5 tokens and dcp=16 about 6·10**4."""
    dcp = draw(dst.dcp_sizes())
    interleave = draw(dst.interleaves())
    block_size = draw(dst.block_sizes(interleave, max_multiple=4))
    n_requests = draw(st.integers(1, 4))
    cap = min(max_length, budget // dcp) // n_requests
    context_lens = [
        draw(dst.lengths(dcp, interleave, max_value=cap)) for _ in range(n_requests)
    ]
    return dcp, interleave, block_size, context_lens


@given(cfg=paged_configs(), seed=dst.seeds(), spare=st.integers(0, 3))
@example(cfg=(1, 1, 1, [0, 1]), seed=0, spare=0)  # an empty request next to a non-empty one
@example(cfg=(3, 2, 4, [25, 0, 24, 1]), seed=1, spare=2)
@example(cfg=(1, 1, 1, [10**5]), seed=2, spare=0)  # the longest context, one block per token
@example(cfg=(2, 128, 256, [10**5 // 2 + 1, 10**5 // 2 - 1]), seed=3, spare=1)
@example(cfg=(16, 1, 16, [31_250, 31_249]), seed=4, spare=3)
@example(cfg=(7, 16, 48, [33_333, 1, 0, 33_336]), seed=5, spare=0)
def test_slot_mapping_is_a_partition_into_distinct_slots(cfg, seed, spare):
    dcp, interleave, block_size, context_lens = cfg
    virtual = block_size * dcp
    table = _block_table(seed, context_lens, virtual, spare)
    n_req, width = table.shape
    longest = max(context_lens)
    note(f"table shape {tuple(table.shape)}")

    # Requests side by side as [n_req, longest]; every token sees its request's table row through
    # a stride-0 view (nothing of size tokens x blocks is materialised). Padding tokens sit at
    # position 0 and are masked out of every check.
    pos = torch.arange(longest).expand(n_req, longest)
    valid = pos < torch.tensor(context_lens).unsqueeze(1)
    pos = torch.where(valid, pos, torch.zeros_like(pos))
    rows = table.unsqueeze(1).expand(n_req, longest, width)
    slots = torch.stack(
        [layout.slot_mapping(pos, rows, r, dcp, block_size, interleave) for r in range(dcp)]
    )  # [dcp, n_req, longest]
    assert slots.dtype == torch.int64 and slots.shape == (dcp, n_req, longest)

    owned = slots != -1
    # each real token is owned on exactly one rank ...
    assert torch.equal(owned.sum(0)[valid], torch.ones(int(valid.sum()), dtype=torch.int64))
    # ... and that rank is owner(position)
    owners = layout.owner(pos, dcp, interleave)
    expected_owned = owners.unsqueeze(0) == torch.arange(dcp).view(-1, 1, 1)
    assert torch.equal(owned[:, valid], expected_owned[:, valid])

    vblock = pos // virtual
    expected_block = torch.gather(table, 1, vblock)
    local = layout.local_index(pos, dcp, interleave)
    for r in range(dcp):
        mine = owned[r] & valid
        s = slots[r][mine]
        # no two tokens share a slot on one rank
        assert s.unique().numel() == s.numel(), f"slot collision on rank {r}"
        # the slot lies in the physical block the shared table names for the virtual block
        assert torch.equal(s // block_size, expected_block[mine])
        assert bool((expected_block[mine] >= 0).all())
        # and rank r's local stream is paged by the same table with block size B
        j = local[mine]
        assert torch.equal(s, torch.gather(table, 1, local // block_size)[mine] * block_size + j % block_size)

    # Flattened batch (one table row per token, as the runtime passes it) gives the same slots.
    if valid.sum() * width <= 2_000_000:
        req = torch.arange(n_req).unsqueeze(1).expand(n_req, longest)[valid]
        flat_pos = pos[valid]
        for r in range(dcp):
            flat = layout.slot_mapping(flat_pos, table[req], r, dcp, block_size, interleave)
            assert torch.equal(flat, slots[r][valid])


@given(
    dcp=dst.dcp_sizes(),
    interleave=st.sampled_from([2, 4, 8, 16, 128]),
    block_size=st.integers(1, 512),
)
def test_slot_mapping_rejects_block_size_not_multiple_of_interleave(dcp, interleave, block_size):
    if block_size % interleave == 0:
        block_size += 1
    pos = torch.arange(4)
    rows = torch.zeros(4, 1, dtype=torch.int64)
    with pytest.raises(ConfigError, match=r"multiple of interleave") as info:
        layout.slot_mapping(pos, rows, 0, dcp, block_size, interleave)
    assert isinstance(info.value, ValueError)
    # the suggested interleave really divides the block size
    suggested = int(str(info.value).rsplit(":", 1)[1])
    assert block_size % suggested == 0


@pytest.mark.parametrize("block_size", [0, -16])
def test_slot_mapping_rejects_non_positive_block_size(block_size):
    pos = torch.arange(4)
    rows = torch.zeros(4, 1, dtype=torch.int64)
    with pytest.raises(ConfigError, match="block_size"):
        layout.slot_mapping(pos, rows, 0, 2, block_size, 1)


@pytest.mark.parametrize("rank", [-1, 2, 7])
def test_slot_mapping_rejects_rank_outside_the_dcp_group(rank):
    pos = torch.arange(4)
    rows = torch.zeros(4, 1, dtype=torch.int64)
    with pytest.raises(ConfigError, match="rank"):
        layout.slot_mapping(pos, rows, rank, 2, 16, 1)


def test_slot_mapping_worked_example():
    # dcp=2, I=2, B=4: virtual block of 8 tokens; table [5, 3]
    pos = torch.arange(12)
    rows = torch.tensor([5, 3]).expand(12, 2)
    s0 = layout.slot_mapping(pos, rows, 0, 2, 4, 2)
    s1 = layout.slot_mapping(pos, rows, 1, 2, 4, 2)
    assert s0.tolist() == [20, 21, -1, -1, 22, 23, -1, -1, 12, 13, -1, -1]
    assert s1.tolist() == [-1, -1, 20, 21, -1, -1, 22, 23, -1, -1, 12, 13]


@given(cfg=paged_configs(max_length=2_000, budget=20_000), seed=dst.seeds(), spare=st.integers(0, 3))
@example(cfg=(3, 2, 4, [25, 0, 24, 1]), seed=1, spare=2)
def test_slot_of_is_slot_mapping_per_token(cfg, seed, spare):
    """The Python-int form (decode steps) gives every token the tensor form's slot on every rank."""
    dcp, interleave, block_size, context_lens = cfg
    table = _block_table(seed, context_lens, block_size * dcp, spare)
    rows = table.tolist()
    for req, n in enumerate(context_lens):
        pos = torch.arange(n)
        for r in range(dcp):
            want = layout.slot_mapping(pos, table[req].expand(n, -1), r, dcp, block_size, interleave).tolist()
            assert [layout.slot_of(p, rows[req], r, dcp, block_size, interleave) for p in range(n)] == want


@given(dcp=st.sampled_from([1, 2, 4]), interleave=st.sampled_from([1, 2]), seed=dst.seeds(),
       lens=st.lists(st.tuples(st.integers(0, 300), st.integers(1, 70)), min_size=1, max_size=5),
       sliding=st.booleans())
def test_step_inputs_agree_on_both_sides_of_the_small_step_cutoff(dcp, interleave, seed, lens, sliding):
    """``build_step_inputs`` computes slots and local lengths on Python ints for steps of at most
    ``SMALL_STEP_TOKENS`` tokens and on tensors above: both give the same inputs (the sliding
    layers' slots too)."""
    from dcpgraph.mesh import Mesh
    from dcpgraph.runtime import step_inputs

    block_size = 4 * interleave
    gen = torch.Generator().manual_seed(seed)
    chunks, next_block = [], 0
    for i, (start, n) in enumerate(lens):
        blocks = -(-(start + n) // (block_size * dcp))
        table = (torch.randperm(1000, generator=gen)[:blocks] + next_block).tolist()
        next_block += 1000
        chunks.append(step_inputs.Chunk(i, tuple(range(n)), start, tuple(table),
                                        sliding_table=tuple(reversed(table)) if sliding else None))
    mesh = Mesh(tp=1, dcp=dcp)
    small = step_inputs.build_step_inputs(chunks, mesh, block_size, interleave)
    cutoff = step_inputs.SMALL_STEP_TOKENS
    try:
        step_inputs.SMALL_STEP_TOKENS = -1  # every step on tensors
        large = step_inputs.build_step_inputs(chunks, mesh, block_size, interleave)
    finally:
        step_inputs.SMALL_STEP_TOKENS = cutoff
    for a, b in zip([small[0], *small[1]], [large[0], *large[1]]):
        assert a.keys() == b.keys()
        for key in a:
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
