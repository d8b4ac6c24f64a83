"""Host KV caches on transparent huge pages (:mod:`dcpgraph.runtime.host_memory`)."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from dcpgraph.runtime import host_memory

MIB = 1 << 20


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_zeros_is_a_zeroed_writable_tensor_of_the_shape(dtype, monkeypatch):
    monkeypatch.delenv("DCPGRAPH_HUGE_PAGES", raising=False)
    shape = (600, 16, 2, 128)  # 2.3-9.4 MiB: over one huge page in every dtype
    t = host_memory.zeros(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous() and t.device.type == "cpu"
    assert t.view(torch.uint8).count_nonzero() == 0
    t.view(torch.uint8).fill_(1)
    assert int(t.view(torch.uint8).sum()) == t.numel() * t.element_size()
    if host_memory.status():
        pytest.skip(f"huge pages not asked for here: {host_memory.status()}")
    assert t.data_ptr() % host_memory.HUGE_PAGE == 0


def test_the_tensor_keeps_its_memory_alive():
    t = host_memory.zeros((4 * MIB,), torch.uint8)
    t[::4096] = 7
    gc.collect()  # nothing but the tensor refers to the mapping
    assert int(t[::4096].sum()) == 7 * (4 * MIB // 4096)
    view = t[MIB:]
    del t
    gc.collect()
    assert int(view[::4096].sum()) == 7 * (3 * MIB // 4096)


def test_small_tensors_other_devices_and_the_switch_fall_back_to_torch_zeros(monkeypatch):
    small = host_memory.zeros((16, 16), torch.float32)
    assert small.count_nonzero() == 0 and small.shape == (16, 16)
    elsewhere = host_memory.zeros((4, MIB), torch.float32, "meta")  # another device: torch.zeros there
    assert elsewhere.device.type == "meta" and elsewhere.shape == (4, MIB)
    monkeypatch.setenv("DCPGRAPH_HUGE_PAGES", "0")
    assert host_memory.status() == "disabled by DCPGRAPH_HUGE_PAGES=0"
    t = host_memory.zeros((4, MIB), torch.float32)
    assert t.count_nonzero() == 0 and t.shape == (4, MIB)


def _mapping_of(address: int) -> dict[str, str]:
    """The ``/proc/self/smaps`` fields of the mapping that holds ``address``."""
    fields, inside = {}, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            if inside:
                break
            inside = lo <= address < hi
        elif inside:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields


def test_the_advice_reaches_the_kernel(monkeypatch):
    """The mapping under the tensor carries the kernel's huge-page advice (``hg`` in its VmFlags),
    over whole 2 MiB pages from the tensor's first byte. Whether the kernel then grants huge pages
    (``AnonHugePages``) is its decision: a machine short of contiguous memory may not, which is why
    nothing here or in the results depends on it."""
    monkeypatch.delenv("DCPGRAPH_HUGE_PAGES", raising=False)
    if host_memory.status():
        pytest.skip(f"huge pages not asked for here: {host_memory.status()}")
    t = host_memory.zeros((8 * MIB,), torch.uint8)
    t[::4096] = 1  # fault every page in
    fields = _mapping_of(t.data_ptr())
    assert "hg" in fields["VmFlags"].split(), fields
    assert fields["THPeligible"] == "1", fields


def test_engine_caches_on_the_host_use_it():
    from dcpgraph.program import CacheSpec, Lowering
    from dcpgraph.runtime.executors import allocate_caches

    class Program:
        lowering = Lowering(block_size=16)
        caches = [CacheSpec(name, 0, role, heads=2, dim=128, dtype=torch.bfloat16) for name, role in (("k0", "k"), ("v0", "v"))]
        recurrent_states = ()  # an attention-only model

    caches = allocate_caches(Program(), 512)  # 4 MiB each
    for c in caches.values():
        assert c.shape == (512, 16, 2, 128) and c.count_nonzero() == 0
        if not host_memory.status():
            assert c.data_ptr() % host_memory.HUGE_PAGE == 0
