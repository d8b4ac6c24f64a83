"""``dcpgraph.kv_cache_write_``'s native CPU kernel (``ops/csrc/kv_cache_write.h``, registered when
the paged-decode extension loads) against the op's meaning, :func:`dcpgraph.ops.paged.write_slots`."""

from __future__ import annotations

import pytest
import torch

from dcpgraph.ops import native, paged

write = torch.ops.dcpgraph.kv_cache_write_


@pytest.fixture(scope="module", autouse=True)
def _loaded():
    if not native.available():
        pytest.skip(f"native kernel unavailable (the op keeps its Python kernel): {native.reason}")
    assert torch._C._dispatch_has_kernel_for_dispatch_key("dcpgraph::kv_cache_write_", "CPU")


def _both(cache, new, slots):
    got, want = cache.clone(), cache.clone()
    write(got, new, slots)
    paged.write_slots(want, new, slots)
    return got, want


@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_rows_land_in_their_slots_and_minus_one_skips(dtype, slot_dtype):
    cache = torch.full((5, 4, 2, 3), 7.0, dtype=dtype)
    new = torch.randn(4, 2, 3).to(dtype)
    slots = torch.tensor([5, -1, 19, 0], dtype=slot_dtype)
    got, want = _both(cache, new, slots)
    assert torch.equal(got, want)
    assert torch.equal(got[1, 1], new[0]) and torch.equal(got[4, 3], new[2]) and torch.equal(got[0, 0], new[3])
    assert int((got != 7.0).any(-1).any(-1).sum()) == 3  # only the three owned slots changed


def test_a_bad_slot_raises_before_any_row_is_written():
    cache = torch.zeros(2, 4, 1, 8)
    with pytest.raises(IndexError, match="slot 8 of token 1 is outside the cache's 8 slots"):
        write(cache, torch.ones(3, 1, 8), torch.tensor([0, 8, 1]))
    assert not cache.any()


@pytest.mark.parametrize("case", ["strided cache", "dtype conversion", "non-contiguous rows"])
def test_other_layouts_take_the_general_path(case):
    if case == "strided cache":  # the head and feature dims swapped in memory
        cache, new = torch.zeros(3, 4, 8, 2).transpose(2, 3), torch.randn(3, 2, 8)
    elif case == "dtype conversion":  # fp32 rows into a bf16 cache
        cache, new = torch.zeros(3, 4, 2, 8, dtype=torch.bfloat16), torch.randn(3, 2, 8)
    else:
        cache, new = torch.zeros(3, 4, 2, 8), torch.randn(3, 8, 2).transpose(1, 2)
    got, want = _both(cache, new, torch.tensor([11, -1, 2]))
    assert torch.equal(got, want) and got.any()


def test_latent_cache_of_one_head():
    """MLA's latent cache [NB, B, 1, 576] written from [T, 1, 576] rows."""
    cache = torch.zeros(4, 16, 1, 576, dtype=torch.bfloat16)
    new = torch.randn(5, 1, 576).to(torch.bfloat16)
    got, want = _both(cache, new, torch.tensor([0, 17, 63, -1, 30]))
    assert torch.equal(got, want)


def _fp8_reference(cache, scales, new, slots):
    """The op's meaning: quantize_fp8, then the bytes and the scales written by write_slots."""
    from dcpgraph.ops import quant

    values, token_scales = quant.quantize_fp8(new)
    paged.write_slots(cache.view(torch.uint8), values.view(torch.uint8), slots)
    paged.write_slots(scales, token_scales, slots)


def _fp8_case(heads, d, dtype, seed, nb=4, block=4):
    from dcpgraph.ops import quant

    gen = torch.Generator().manual_seed(seed)
    new = (torch.randn(5, heads, d, generator=gen) * torch.logspace(-12, 12, 5).view(5, 1, 1)).to(dtype)
    cache = torch.zeros(nb, block, heads, d, dtype=quant.FP8_DTYPE)
    scales = torch.full((nb, block, heads, quant.scale_groups(d)), -1.0)
    return new, cache, scales


@pytest.mark.parametrize("heads, d, dtype", [(4, 128, torch.bfloat16), (1, 576, torch.bfloat16),
                                             (2, 100, torch.float32), (1, 64, torch.float16)])
def test_fp8_write_quantises_as_quantize_fp8_does(heads, d, dtype, monkeypatch):
    """The native fp8 write (bytes and scales) equals quantize_fp8 + write_slots bit for bit, and
    it is the native kernel that wrote (spied)."""
    assert paged.FP8_WRITE.enabled(), paged.FP8_WRITE.reason
    new, cache, scales = _fp8_case(heads, d, dtype, seed=heads * d)
    slots = torch.tensor([6, -1, 0, 15, 9], dtype=torch.int32)
    want_cache, want_scales = cache.clone(), scales.clone()
    _fp8_reference(want_cache, want_scales, new, slots)
    calls = []
    real = native._module.kv_cache_write_fp8
    monkeypatch.setattr(native._module, "kv_cache_write_fp8", lambda *a: calls.append(1) or real(*a))
    torch.ops.dcpgraph.kv_cache_write_fp8_(cache, new, slots, scales)
    assert calls == [1]
    assert torch.equal(cache.view(torch.uint8), want_cache.view(torch.uint8)) and torch.equal(scales, want_scales)
    assert bool((scales[1, 2] != -1).all()) and bool((scales[1, 3] == -1).all())  # slot 6 written, 7 not


def test_fp8_write_checks_every_slot_first_and_other_layouts_fall_back():
    new, cache, scales = _fp8_case(2, 128, torch.bfloat16, seed=1)
    with pytest.raises(IndexError, match="outside the cache's 16 slots"):
        torch.ops.dcpgraph.kv_cache_write_fp8_(cache, new, torch.tensor([0, 1, 2, 3, 16]), scales)
    assert not cache.view(torch.uint8).any() and bool((scales == -1).all())
    # scales laid out with the head dim last (not dense rows): the torch path writes the same values
    odd_scales = torch.full((4, 4, 1, 2), -1.0).transpose(2, 3)
    want_cache, want_scales = cache.clone(), odd_scales.clone()
    slots = torch.tensor([0, 5, -1, 2, 3])
    _fp8_reference(want_cache, want_scales, new, slots)
    torch.ops.dcpgraph.kv_cache_write_fp8_(cache, new, slots, odd_scales)
    assert torch.equal(cache.view(torch.uint8), want_cache.view(torch.uint8)) and torch.equal(odd_scales, want_scales)
