"""KV-cache sizing from ``gpu_memory_utilization`` (:mod:`dcpgraph.memory`).

References: the formula itself, ``(F · M / S − weights − peak) // bytes_per_block``, computed here
from the figures the sizing reports and from independent ones (the weights of the traced model's
parameters, the memory the test fakes); the caches the engine actually allocated.
"""

from __future__ import annotations

import types

import pytest
import torch

import dcpgraph
from dcpgraph import ConfigError
from dcpgraph import memory as mem
from dcpgraph.config import DcpgraphConfig
from dcpgraph.kv_budget import kv_bytes_per_block
from dcpgraph.models import build_model
from dcpgraph.serving.cli import build_parser, kv_sizing_line, llm_options
from dcpgraph.serving.metrics import cache_config_info

MiB = 1 << 20
OPTIONS = {"block_size": 4, "max_model_len": 64, "max_num_batched_tokens": 32, "backend": "eager"}


@pytest.fixture(scope="module")
def traced():
    return dcpgraph.trace(build_model("qwen3", dtype=torch.float32))


def _expected_blocks(fraction: float, memory: int, ranks: int, weights: int, peak: int, per_block: int) -> int:
    return (int(fraction * memory / ranks) - weights - peak) // per_block


def _cache_bytes(engine) -> int:
    return sum(c.numel() * c.element_size() for c in engine.executor.rank_caches(0).values())


def test_on_the_host_the_kv_cache_follows_the_fraction(traced, monkeypatch):
    """``--device cpu``-style: the host memory is faked to a fixed 64 MiB (the real figure moves
    between two compiles on a busy machine); two fractions give the formula's counts, in the
    ratio the formula predicts, and the engine allocates exactly those blocks."""
    monkeypatch.setattr(mem, "host_memory_bytes", lambda: 64 * MiB)
    engines = {f: dcpgraph.compile(traced, tp=2, dcp=2, gpu_memory_utilization=f, **OPTIONS) for f in (0.25, 0.5)}
    sizings = {f: e.memory_report()["kv_sizing"] for f, e in engines.items()}
    weights = sum(p.numel() * p.element_size() for p in traced.state.values()) // 2  # tp=2 halves (nearly) all
    for f, s in sizings.items():
        assert s["policy"] == "gpu_memory_utilization" and s["device"] == "cpu"
        assert (s["utilization"], s["device_memory"], s["ranks_sharing"]) == (f, 64 * MiB, 2)  # emulated: one host
        assert weights <= s["weight_bytes"] <= 2 * weights
        assert 0 < s["activation_peak_bytes"] < 8 * MiB
        assert s["bytes_per_block"] == kv_bytes_per_block(engines[f].program)
        assert s["num_blocks"] == _expected_blocks(f, 64 * MiB, 2, s["weight_bytes"], s["activation_peak_bytes"],
                                                   s["bytes_per_block"])
        assert engines[f].memory_report()["num_blocks"] == s["num_blocks"]
        assert _cache_bytes(engines[f]) == s["num_blocks"] * s["bytes_per_block"]
    low, high = sizings[0.25], sizings[0.5]
    overhead = low["weight_bytes"] + low["activation_peak_bytes"]
    # KV + weights + peak is the fraction's share: doubling F doubles it, to within a block
    share = {f: s["num_blocks"] * s["bytes_per_block"] + overhead for f, s in sizings.items()}
    assert abs(share[0.5] - 2 * share[0.25]) <= 2 * low["bytes_per_block"]
    assert high["num_blocks"] > 2 * low["num_blocks"]  # the fixed overhead is paid once per fraction


def test_on_the_host_without_the_flag_the_default_sizing_stays(traced, monkeypatch):
    monkeypatch.setattr(mem, "host_memory_bytes", lambda: pytest.fail("the host memory must not be read"))
    engine = dcpgraph.compile(traced, max_num_seqs=3, **OPTIONS)
    assert engine.memory_report()["kv_sizing"] == {"policy": "cache_size", "num_blocks": 3 * 64 // 4}
    assert "from the cache-size options or the default" in kv_sizing_line(engine.memory_report())


def test_the_real_host_memory_sizes_a_working_cache(traced):
    engine = dcpgraph.compile(traced, gpu_memory_utilization=0.0005, **OPTIONS)
    sizing = engine.memory_report()["kv_sizing"]
    assert 0 < sizing["device_memory"] <= mem.os.sysconf("SC_PAGE_SIZE") * mem.os.sysconf("SC_PHYS_PAGES")
    assert sizing["num_blocks"] >= 1
    assert engine.generate([[1, 2, 3]], 4)[0]
    assert "--gpu-memory-utilization 0.0005" in kv_sizing_line(engine.memory_report())


def test_host_memory_is_the_smaller_of_meminfo_and_the_cgroup_room(tmp_path, monkeypatch):
    meminfo, limit, usage = tmp_path / "meminfo", tmp_path / "max", tmp_path / "current"
    meminfo.write_text("MemTotal:       32000000 kB\nMemAvailable:   20000000 kB\n")
    limit.write_text("8589934592\n")
    usage.write_text("1073741824\n")
    monkeypatch.setattr(mem, "MEMINFO", str(meminfo))
    monkeypatch.setattr(mem, "CGROUP_V2", (str(limit), str(usage)))
    monkeypatch.setattr(mem, "CGROUP_V1", (str(tmp_path / "none"), str(tmp_path / "none")))
    assert mem.host_memory_bytes() == 7 << 30  # 8 GiB limit - 1 GiB used < 20 GB available
    limit.write_text("max\n")  # cgroup v2: no limit
    assert mem.host_memory_bytes() == 20000000 * 1024
    assert mem.device_memory("cpu") == mem.DeviceMemory(20000000 * 1024, 20000000 * 1024)


def _fake_accelerator(monkeypatch, kind: str, total: int, free: int, reserved: int = 0, allocated: int = 0) -> None:
    """``torch.<kind>``'s memory queries answer as a device of ``total`` bytes with ``free`` free
    and ``reserved − allocated`` cached by this process (``torch.npu`` is made where absent)."""
    module = getattr(torch, kind, None)
    if module is None:
        module = types.SimpleNamespace()
        monkeypatch.setattr(torch, kind, module, raising=False)
    monkeypatch.setattr(module, "mem_get_info", lambda device=None: (free, total), raising=False)
    monkeypatch.setattr(module, "memory_reserved", lambda device=None: reserved, raising=False)
    monkeypatch.setattr(module, "memory_allocated", lambda device=None: allocated, raising=False)


@pytest.mark.parametrize("kind", ["cuda", "npu"])
def test_a_faked_device_gets_the_formula_exactly(traced, monkeypatch, kind):
    """The device's memory comes from :func:`dcpgraph.memory.device_memory` (faked: 80 GiB, of which
    the allocator caches 2 GiB unused); blocks = (0.9 · 80 GiB − weights − peak) // block bytes."""
    program = dcpgraph.compile(traced, num_blocks=4, **OPTIONS).program
    _fake_accelerator(monkeypatch, kind, 80 << 30, 70 << 30, 3 << 30, 1 << 30)
    assert mem.device_memory(f"{kind}:0") == mem.DeviceMemory(80 << 30, 72 << 30)
    sizing = mem.size_for_utilization(program, 0.9, f"{kind}:0", ranks=1, max_num_batched_tokens=32,
                                      max_num_seqs=8, max_model_len=64)
    weights = sum(p.numel() * p.element_size() for p in traced.state.values())
    peak = mem.activation_peak_bytes(program, tokens=32, requests=8)
    per_block = kv_bytes_per_block(program)
    assert (sizing.weight_bytes, sizing.activation_peak_bytes, sizing.bytes_per_block) == (weights, peak, per_block)
    assert sizing.num_blocks == (int(0.9 * (80 << 30)) - weights - peak) // per_block
    assert sizing.kv_bytes == int(0.9 * (80 << 30)) - weights - peak
    with pytest.raises(ConfigError, match="only 4.00 GiB are free"):
        _fake_accelerator(monkeypatch, kind, 80 << 30, 4 << 30)
        mem.size_for_utilization(program, 0.9, f"{kind}:0", ranks=1, max_num_batched_tokens=32, max_num_seqs=8,
                                 max_model_len=64)


def test_on_a_device_compile_defaults_to_ninety_percent_shared_by_the_emulated_ranks(traced, monkeypatch):
    """compile with the program's ranks on a (faked) CUDA device and no cache size: F = 0.9, the
    two emulated ranks share the device; the caches themselves stay where the weights are."""
    import dcpgraph.api as api

    _fake_accelerator(monkeypatch, "cuda", 64 * MiB, 64 * MiB)
    monkeypatch.setattr(api, "program_device", lambda program: torch.device("cuda:0"))
    engine = dcpgraph.compile(traced, tp=2, **OPTIONS)
    s = engine.memory_report()["kv_sizing"]
    assert (s["utilization"], s["device"], s["device_memory"], s["ranks_sharing"]) == (0.9, "cuda:0", 64 * MiB, 2)
    assert s["num_blocks"] == _expected_blocks(0.9, 64 * MiB, 2, s["weight_bytes"], s["activation_peak_bytes"],
                                               s["bytes_per_block"])
    explicit = dcpgraph.compile(traced, tp=2, num_blocks=5, **OPTIONS)  # an explicit size wins on a device too
    assert explicit.memory_report()["kv_sizing"] == {"policy": "cache_size", "num_blocks": 5}


def test_ranks_sharing_the_host():
    cpu, cuda = torch.device("cpu"), torch.device("cuda:0")
    assert mem.ranks_sharing(cuda, 8, distributed=True) == 1
    assert mem.ranks_sharing(cuda, 8, distributed=False) == 8
    assert mem.ranks_sharing(cpu, 8, distributed=True, ranks_on_host=4) == 4


def test_ranks_on_the_host_default_to_torchruns_local_world_size(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert mem.ranks_sharing(torch.device("cpu"), 8, distributed=True) == 3
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert mem.ranks_sharing(torch.device("cpu"), 8, distributed=True) == 8


def test_a_fraction_that_buys_no_block_is_refused(traced, monkeypatch):
    monkeypatch.setattr(mem, "host_memory_bytes", lambda: 1 * MiB)
    with pytest.raises(ConfigError, match="less than one .*-byte block"):
        dcpgraph.compile(traced, gpu_memory_utilization=0.01, **OPTIONS)


def test_the_fraction_and_an_explicit_cache_size_are_refused_together():
    for option, flag in (("num_blocks", "--num-gpu-blocks-override"), ("kv_cache_tokens", "--kv-cache-tokens"),
                         ("kv_cache_bytes_per_rank", "--kv-cache-memory-bytes")):
        with pytest.raises(ConfigError, match=f"gpu_memory_utilization=0.5 and {option} .*{flag}"):
            DcpgraphConfig.from_compile_options(gpu_memory_utilization=0.5, **{option: 64})
    with pytest.raises(ConfigError, match="--gpu-memory-utilization and --num-gpu-blocks-override"):
        llm_options(build_parser().parse_args(["/m", "--gpu-memory-utilization", "0.5",
                                               "--num-gpu-blocks-override", "8"]))
    for bad in (0, 1.5, -0.1, True, "0.5"):
        with pytest.raises(ConfigError, match=r"fraction in \(0, 1\]"):
            DcpgraphConfig.from_compile_options(gpu_memory_utilization=bad)


def test_the_flag_reaches_the_ranks_and_the_metrics():
    options = llm_options(build_parser().parse_args(["/m", "--gpu-memory-utilization", "0.3"]))
    assert options["gpu_memory_utilization"] == 0.3
    settings = DcpgraphConfig.from_llm_kwargs(model="/m", **options)
    sizing = {"policy": "gpu_memory_utilization", "utilization": 0.3, "kv_bytes": 12345}
    info = cache_config_info(settings, 7, sizing)
    assert (info["gpu_memory_utilization"], info["kv_cache_memory_bytes"], info["num_gpu_blocks"]) == \
        ("0.3", "12345", "7")


@pytest.mark.slow
def test_worker_ranks_size_from_the_host_and_agree(checkpoints):
    """``LLM`` with tp=2 worker processes and a host fraction: each rank reads the host's memory
    itself, the two take the smaller count (one block table), and the figures are rank 0's."""
    from dcpgraph import LLM, SamplingParams

    llm = LLM(model=checkpoints["qwen3"], tensor_parallel_size=2, dtype="float32", block_size=4, max_model_len=64,
              gpu_memory_utilization=0.0005)
    try:
        report = llm.engine.memory_report()
        sizing = report["kv_sizing"]
        assert (sizing["policy"], sizing["device"], sizing["ranks_sharing"]) == ("gpu_memory_utilization", "cpu", 2)
        assert llm.num_kv_blocks() == report["num_blocks"] <= (
            int(0.0005 * sizing["device_memory"] / 2) - sizing["weight_bytes"] - sizing["activation_peak_bytes"]
        ) // sizing["bytes_per_block"]
        out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(temperature=0, max_tokens=4))
        assert len(out[0].outputs[0].token_ids) >= 1
    finally:
        llm.shutdown()
