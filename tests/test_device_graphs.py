"""Device graphs (:mod:`dcpgraph.backends.device_graphs`): which placements capture their decode
buckets, and the capture wrapper's logic run on the CPU.

A CUDA machine is faked as in ``tests/test_devices.py`` (:class:`~dcpgraph.devices.DeviceProbe`),
so the decision is checked through :func:`dcpgraph.api.compile_programs`, the code that builds an
engine's graphs. The wrapper's copy-in, address checks and replay counts run against the plain call
with :class:`~dcpgraph.testing.device_graphs.HostReplayCapture`, a CPU stand-in that reads only the
buffers it captured and rewrites the same output tensors, as a CUDA graph does. Capture on a real
GPU is in the gpu tier (``tests/test_gpu.py``).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import dcpgraph
import dcpgraph.api as api
from dcpgraph import ConfigError
from dcpgraph.api import compile_programs, engine_for
from dcpgraph.backends import compile_backend
from dcpgraph.backends.device_graphs import CudaCaptures, DeviceGraph, device_graphs_for
from dcpgraph.backends.fallback import FallbackGraph
from dcpgraph.compile_config import configuration
from dcpgraph.config import DcpgraphConfig
from dcpgraph.devices import DeviceProbe
from dcpgraph.models import build_model
from dcpgraph.options import compile_options
from dcpgraph.serving.cli import build_parser, llm_options
from dcpgraph.testing.device_graphs import (
    HostReplayCaptures,
    replays_and_decode_steps,
    serve_arrivals,
)
from dcpgraph.testing.generation import hf_greedy


def identity_backend(gm, example_inputs):
    """A compiling backend that compiles nothing (the GraphModule itself): graphs exist, run fast."""
    return gm


@pytest.fixture(scope="module")
def model():
    return build_model("qwen3", dtype=torch.float32)


@pytest.fixture(scope="module")
def traced(model):
    return dcpgraph.trace(model)


# -- which placements capture ------------------------------------------------------------------
def test_only_a_cuda_device_with_the_mode_on_gets_captures():
    assert isinstance(device_graphs_for("cuda:1", "FULL_DECODE_ONLY"), CudaCaptures)
    assert isinstance(device_graphs_for(torch.device("cuda"), "FULL_DECODE_ONLY"), CudaCaptures)
    assert device_graphs_for("cuda:0", "NONE") is None
    assert device_graphs_for("cpu", "FULL_DECODE_ONLY") is None
    assert device_graphs_for("meta", "FULL_DECODE_ONLY") is None
    with pytest.raises(ValueError, match="cudagraph_mode must be one of"):
        device_graphs_for("cuda", "PIECEWISE")


@pytest.fixture
def fake_cuda(monkeypatch):
    """This machine with two CUDA devices, as far as dcpgraph asks."""
    monkeypatch.setattr(DeviceProbe, "count", lambda self, kind: (2, "") if kind in ("cpu", "cuda") else (0, "none"))


SMALL = dict(num_blocks=32, max_model_len=64, block_size=4, capture_limit=4)


def _graphs(traced, **options):
    """The graphs an engine would get, built by :func:`compile_programs` (nothing is compiled yet)."""
    return compile_programs(traced, **SMALL, **options).graphs


@pytest.fixture(scope="module")
def compiled(traced):
    """The model through the passes once (the file's main cost), for every test that can share it."""
    return compile_programs(traced, **SMALL, backend="eager")


@pytest.fixture(scope="module")
def lowered(compiled):
    return compiled.program


def _graphs_for(lowered, **options):
    """The same as :func:`_graphs` without running the passes again: ``compile_programs``' last step
    (its configuration, the program placed, :func:`dcpgraph.api._compiled_graphs`) on a program
    lowered once."""
    config = configuration(lowered, DcpgraphConfig.from_compile_options(**SMALL, **options))
    return api._compiled_graphs(api.placed(lowered, config.opts["device"]), config)


def test_a_cuda_placement_captures_its_decode_buckets_and_not_the_mixed_graph(traced, lowered, fake_cuda):
    graphs = _graphs(traced, device="cuda", backend="aot_eager")
    assert _graphs_for(lowered, device="cuda", backend="aot_eager").report() == graphs.report()  # the shortcut
    assert isinstance(graphs.device_graphs, CudaCaptures) and graphs.report()["device_graphs"] == "cuda"
    decode = graphs.get(("decode", 2))
    assert isinstance(decode, DeviceGraph) and decode.new_capture is graphs.device_graphs
    assert isinstance(decode.fn, FallbackGraph) and decode.fn.status["backend"] == "aot_eager"  # compiled inside
    assert isinstance(graphs.get(("verify", "2x3")), DeviceGraph)
    assert isinstance(graphs.get("mixed"), FallbackGraph)  # dynamic shapes: never captured


@pytest.mark.parametrize("options", [
    {"device": "cpu", "backend": "aot_eager"},
    {"device": "cuda", "backend": "aot_eager", "cudagraph_mode": "NONE"},  # the off switch
])
def test_cpu_and_the_off_switch_keep_the_compiled_buckets_uncaptured(lowered, fake_cuda, options):
    graphs = _graphs_for(lowered, **options)
    assert graphs.device_graphs is None and "device_graphs" not in graphs.report()
    assert isinstance(graphs.get(("decode", 2)), FallbackGraph)


@pytest.mark.parametrize("given", [{"enforce_eager": True}, {"backend": "eager"}])
def test_eager_captures_nothing_on_cuda(lowered, fake_cuda, given):
    """``--enforce-eager`` (LLM's and serve's) is compile's ``backend="eager"``: nothing compiled or captured."""
    opts = DcpgraphConfig.from_llm_kwargs(model="/m", device="cuda", **given).compile_options()
    graphs = _graphs_for(lowered, device="cuda", backend=opts["backend"], cudagraph_mode=opts["cudagraph_mode"])
    assert graphs.device_graphs is None and graphs.get(("decode", 2)) is None


def test_the_mode_is_an_option_and_a_flag():
    assert compile_options()["cudagraph_mode"] == "FULL_DECODE_ONLY"
    assert compile_options(cudagraph_mode="NONE")["cudagraph_mode"] == "NONE"
    with pytest.raises(ConfigError, match=r"cudagraph_mode must be one of \['FULL_DECODE_ONLY', 'NONE'\]"):
        compile_options(cudagraph_mode="PIECEWISE")
    for argv in (["--cudagraph-mode", "NONE"], ["-O.cudagraph_mode=NONE"]):  # ours and vLLM's spelling
        args = build_parser().parse_args(["/m", *argv])
        settings = DcpgraphConfig.from_llm_kwargs(model="/m", **llm_options(args))
        assert settings.compile_options()["cudagraph_mode"] == "NONE"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["/m", "--cudagraph-mode", "FULL"])


# -- the wrapper against the plain call, on CPU tensors ------------------------------------------
def _step(weight, cache, ids, slots):
    """A toy step with the shapes of the real one: weights read, a cache written in place at the
    step's slots (−1: nothing), outputs from the per-step inputs and the cache."""
    rows = slots >= 0
    cache[slots[rows]] = weight[ids[rows]]
    return weight[ids] * 2 + cache.sum(0), ids.float()


def _inputs(seed: int, rows: int = 4):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 10, (rows,), generator=gen), torch.randperm(8, generator=gen)[:rows] - 2


def test_replays_equal_the_plain_call_step_after_step():
    weight = torch.randn(10, 3)
    caches = {"plain": torch.zeros(8, 3), "captured": torch.zeros(8, 3)}
    makes = HostReplayCaptures()
    graph = DeviceGraph("decode[4]", _step, frozenset({0, 1}), makes)
    kept = []
    for seed in range(6):
        ids, slots = _inputs(seed)
        expected = _step(weight, caches["plain"], ids, slots)
        got = graph(weight, caches["captured"], ids, slots)
        kept.append(got)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        torch.testing.assert_close(caches["captured"], caches["plain"], rtol=0, atol=0)  # written once per step
    assert len(makes.made) == 1 and makes.made[0].args[1] is caches["captured"]  # the cache in place, not a copy
    assert graph.status["device_graph"] == {"kind": "host-replay", "captured": True, "replays": 5,
                                            "uncaptured_calls": 0, "reason": None}
    assert not torch.equal(kept[-1][1], kept[-2][1])  # each replay's outputs are the caller's own


def test_inputs_unlike_the_captured_ones_run_the_plain_call():
    weight, cache = torch.randn(10, 3), torch.zeros(8, 3)
    graph = DeviceGraph("decode[4]", _step, frozenset({0, 1}), HostReplayCaptures())
    graph(weight, cache, *_inputs(0))
    ids, slots = _inputs(1, rows=3)  # another shape
    torch.testing.assert_close(graph(weight, cache, ids, slots), _step(weight, cache.clone(), ids, slots))
    moved = cache.clone()  # a cache at another address
    graph(weight, moved, *_inputs(2))
    status = graph.status["device_graph"]
    assert (status["replays"], status["uncaptured_calls"]) == (0, 2)
    assert status["reason"] == "input 2 has shape (3,), captured (4,)"
    graph(weight, cache, *_inputs(3))
    assert graph.status["device_graph"]["replays"] == 1


def test_a_failed_capture_leaves_the_compiled_call_running():
    class Refusing:
        kind = "refusing"

        def __call__(self):
            return self

        def capture(self, fn, args):
            raise RuntimeError("operation not permitted when stream is capturing")

    weight, cache = torch.randn(10, 3), torch.zeros(8, 3)
    graph = DeviceGraph("decode[4]", _step, frozenset({0, 1}), Refusing())
    with pytest.warns(RuntimeWarning, match="runs uncaptured: capture failed: RuntimeError: operation not permitted"):
        graph(weight, cache, *_inputs(0))
    ids, slots = _inputs(1)
    torch.testing.assert_close(graph(weight, cache, ids, slots), _step(weight, cache.clone(), ids, slots))
    assert graph.status["device_graph"]["captured"] is False and graph.status["device_graph"]["uncaptured_calls"] == 1


# -- an engine whose buckets are captured, on the CPU ---------------------------------------------
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9], [11, 12, 13], [5] * 9, [7, 8]]
ARRIVALS = {0: [PROMPTS[0]], 1: PROMPTS[1:3], 3: [PROMPTS[3]], 6: [PROMPTS[4]]}  # decode batches of 1 to 4


def test_an_engine_with_captured_buckets_equals_hf_and_replays_every_decode_step(model, compiled):
    makes = HostReplayCaptures()
    graphs = compile_backend(compiled.program, identity_backend, distributed=False, device_graphs=makes)
    engine = engine_for(dataclasses.replace(compiled, graphs=graphs))
    assert len(makes.made) == 3  # decode[1], decode[2], decode[4] captured at start-up; mixed not
    assert serve_arrivals(engine, ARRIVALS, 6) == [hf_greedy(model, p, 6) for p in PROMPTS]
    report = engine.report()
    replays, decode_steps = replays_and_decode_steps(report)
    assert len(decode_steps) == 3, decode_steps  # every bucket served
    assert replays == decode_steps
    assert all(s["device_graph"]["uncaptured_calls"] == 0 for n, s in report["graphs"].items() if n != "mixed")
