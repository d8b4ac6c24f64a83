"""Where ranks run (:mod:`dcpgraph.devices`, ``--device``): the choice resolved on the front end,
each worker's device and collective backend, the state moved to it.

The accelerators are faked through :class:`~dcpgraph.devices.DeviceProbe` (what the machine has,
and the calls that make a device current), so the placement rules for CUDA and NPU run here on
the CPU through the same code a GPU or NPU machine runs; what only such a machine can check (the
tensors on it, NCCL) is in the gpu tier (``tests/test_gpu.py``).
"""

from __future__ import annotations

import pytest
import torch

import dcpgraph
import dcpgraph.api as api
from dcpgraph import ConfigError
from dcpgraph.config import DcpgraphConfig
from dcpgraph.devices import DeviceKind, DeviceProbe, RankPlacement, place_rank, resolve_device
from dcpgraph.models import build_model
from dcpgraph.runtime.distributed import backend_for
from dcpgraph.serving.cli import build_parser, llm_options
from dcpgraph.serving.engine_config import EngineConfig
from dcpgraph.serving.llm import checked_checkpoint
from dcpgraph.serving.workers import rank_placement


class FakeProbe(DeviceProbe):
    """A machine with ``counts`` devices of each accelerator kind; records the devices made current."""

    def __init__(self, **counts: int):
        self.counts = counts
        self.made_current: list[str] = []

    def count(self, kind: str) -> tuple[int, str]:
        if kind == "cpu":
            return 1, ""
        n = self.counts.get(kind, 0)
        return n, "" if n else f"the fake machine has no {kind}"

    def set_device(self, device: str) -> None:
        if not device.startswith("cpu"):
            self.made_current.append(device)


@pytest.mark.parametrize("counts, expected", [
    ({}, DeviceKind("cpu")),
    ({"cuda": 4}, DeviceKind("cuda", 4)),
    ({"npu": 8}, DeviceKind("npu", 8)),
    ({"npu": 2, "cuda": 4}, DeviceKind("npu", 2)),  # an Ascend machine with a GPU too: the NPU first
])
def test_auto_takes_an_npu_then_cuda_then_the_cpu(counts, expected):
    assert resolve_device("auto", FakeProbe(**counts)) == expected


def test_a_named_kind_is_taken_as_named():
    probe = FakeProbe(npu=2, cuda=4)
    assert resolve_device("cuda", probe) == DeviceKind("cuda", 4)
    assert resolve_device("cpu", probe) == DeviceKind("cpu")


def test_an_accelerator_the_machine_lacks_is_refused_with_what_there_is():
    with pytest.raises(ConfigError, match=r"device='npu': no npu device here \(the fake machine has no npu\); "
                                          r"available: \['cpu', 'cuda'\]"):
        resolve_device("npu", FakeProbe(cuda=1))
    with pytest.raises(ConfigError, match=r"device must be one of \['auto', 'cpu', 'cuda', 'npu'\], got 'tpu'"):
        resolve_device("tpu", FakeProbe())


def test_this_machine_without_accelerators():
    """The real probe: this CPU build of torch sees no GPU and torch_npu is not installed."""
    assert resolve_device("auto") == DeviceKind("cpu")
    with pytest.raises(ConfigError, match="no cuda device here"):
        resolve_device("cuda")
    with pytest.raises(ConfigError, match="no npu device here"):
        resolve_device("npu")


@pytest.mark.parametrize("kind, count, local_rank, device, backend", [
    ("cuda", 2, 3, "cuda:1", "nccl"),  # more ranks than devices on the node: round robin
    ("cuda", 8, 5, "cuda:5", "nccl"),
    ("npu", 8, 7, "npu:7", "hccl"),
    ("cpu", 1, 3, "cpu", "gloo"),
])
def test_a_rank_takes_its_nodes_device_and_the_kinds_backend(kind, count, local_rank, device, backend):
    probe = FakeProbe(**{kind: count})
    assert place_rank(DeviceKind(kind, count), local_rank, probe) == RankPlacement(device, backend)
    assert probe.made_current == ([] if kind == "cpu" else [device])  # before the process group starts
    assert backend_for(device) == backend


def test_a_worker_places_itself_by_the_front_ends_choice():
    npu = EngineConfig(model="/m", dtype="bfloat16", tensor_parallel_size=8, engine_options={"device": "npu"})
    probe = FakeProbe(npu=8)
    assert rank_placement(npu, 5, probe) == RankPlacement("npu:5", "hccl") and probe.made_current == ["npu:5"]
    assert rank_placement(EngineConfig(model="/m", dtype="float32"), 0, FakeProbe()) == RankPlacement("cpu", "gloo")
    with pytest.raises(ConfigError, match=r"device='npu': this node has no npu device \(the fake machine has no npu\)"):
        rank_placement(npu, 0, FakeProbe(cuda=2))  # a node unlike the head's


def test_the_front_end_resolves_auto_once_for_every_rank(checkpoints, monkeypatch):
    settings = DcpgraphConfig.from_llm_kwargs(model=checkpoints["qwen3"], dtype="float32", max_model_len=64)
    assert checked_checkpoint(settings).config.device == "cpu"
    monkeypatch.setattr(DeviceProbe, "count", lambda self, kind: (2, "") if kind in ("cpu", "cuda") else (0, "none"))
    assert checked_checkpoint(settings).config.device == "cuda"  # what the workers are told, not "auto"


def test_llm_refuses_a_missing_accelerator_before_any_worker_starts(checkpoints):
    from dcpgraph import LLM

    with pytest.raises(ConfigError, match="device='cuda': no cuda device here"):
        LLM(checkpoints["qwen3"], tensor_parallel_size=2, device="cuda", dtype="float32", max_model_len=64)


def test_serve_takes_the_flag():
    args = build_parser().parse_args(["/m", "--device", "cpu"])
    assert DcpgraphConfig.from_llm_kwargs(model="/m", **llm_options(args)).parallel.device == "cpu"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["/m", "--device", "tpu"])


# -- the program's state on its device ---------------------------------------------------------
@pytest.fixture(scope="module")
def traced():
    return dcpgraph.trace(build_model("qwen3", dtype=torch.float32))


def test_each_ranks_state_moves_to_the_programs_device(traced):
    """``Program.device`` moves every rank's slices when they are taken (the same code puts them on
    ``cuda``; ``meta`` stands in for a device here)."""
    program = dcpgraph.compile(traced, tp=2, num_blocks=4, max_model_len=32, backend="eager").program
    on_host = program.local_state(1)
    moved = program.replace(device="meta").local_state(1)
    assert [t.device.type for t in moved] == ["meta"] * len(moved)
    assert [(t.shape, t.dtype) for t in moved] == [(t.shape, t.dtype) for t in on_host]
    assert api.program_device(program.replace(device="meta")) == torch.device("meta")


def test_compile_places_an_in_memory_model_only_when_asked(traced, monkeypatch):
    monkeypatch.setattr(DeviceProbe, "count", lambda self, kind: (2, "") if kind in ("cpu", "cuda") else (0, "none"))
    assert api.placed(traced, "auto") is traced  # its parameters' device (the host)
    assert api.placed(traced, "cpu") is traced
    assert api.placed(traced, "cuda").device == "cuda"
    meta = traced.replace(state={k: v.to("meta") for k, v in traced.state.items()})  # a checkpoint's, unread
    assert api.placed(meta, "auto").device == "cuda"
    assert api.placed(meta, "cpu").device is None


def test_compile_on_the_host_is_unchanged(traced):
    engine = dcpgraph.compile(traced, device="cpu", num_blocks=4, max_model_len=32, backend="eager")
    assert engine.executor.device == torch.device("cpu") and engine.program.device is None
