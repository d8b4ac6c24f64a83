"""Backends: eager fallback (compile and first call), decode buckets, inductor against eager."""

from __future__ import annotations

import warnings

import pytest
import torch

import dcpgraph
from dcpgraph.backends.fallback import FallbackGraph
from dcpgraph.models import build_model

PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9], [11, 12, 13]]


@pytest.fixture(scope="module")
def qwen3():
    model = build_model("qwen3", dtype=torch.float64)
    return model, dcpgraph.trace(model)


@pytest.fixture(scope="module")
def eager_tokens(qwen3):
    _, program = qwen3
    return dcpgraph.compile(program, backend="eager", block_size=4).generate(PROMPTS, 10)


def raise_at_compile(gm, example_inputs):
    raise RuntimeError("converter missing for op X")


def raise_at_first_call(gm, example_inputs):
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]

    def compiled(*args):
        # Write garbage into every slot this step writes, as a half-finished device graph might.
        slots = args[names.index("slot_mapping")]
        for name, a in zip(names, args):
            if "cache" in name:
                a.view(-1, *a.shape[2:])[slots[slots >= 0]] = float("nan")
        raise RuntimeError("GE graph failed to load")

    return compiled


@pytest.mark.parametrize("backend", [raise_at_compile, raise_at_first_call])
def test_fallback_gives_eager_tokens_and_records_reason(qwen3, eager_tokens, backend):
    _, program = qwen3
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = dcpgraph.compile(program, backend=backend, block_size=4)  # captures every graph
        tokens = engine.generate(PROMPTS, 10)
    assert tokens == eager_tokens
    graphs = engine.report()["graphs"]
    assert graphs, "every shape key should be recorded"
    for status in graphs.values():
        assert status["backend"] == "eager"
        expected = "compile failed" if backend is raise_at_compile else "first call failed"
        assert expected in status["fallback"]
    assert any("runs eagerly" in str(w.message) for w in caught)


def test_fallback_warns_once_per_graph_and_later_errors_propagate():
    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    calls = {"n": 0}

    def flaky(gm_, example_inputs):
        def run(*args):
            calls["n"] += 1
            if calls["n"] > 1:
                raise RuntimeError("device lost")
            return gm_(*args)

        return run

    graph = FallbackGraph("g", gm, flaky)
    x = torch.randn(1, 2)
    torch.testing.assert_close(graph(x), gm(x))  # first call works: the graph is proven
    with pytest.raises(RuntimeError, match="device lost"):
        graph(x)  # a proven compiled graph's failure is a real error, not a silent switch
    assert graph.status["fallback"] is None


def test_decode_buckets_pad_without_changing_tokens(qwen3, eager_tokens):
    _, program = qwen3
    engine = dcpgraph.compile(program, backend="eager", block_size=4, capture_limit=4)
    assert engine.generate(PROMPTS, 10) == eager_tokens
    report = engine.report()
    assert report["decode_buckets"] == [1, 2, 4]
    assert report["graph_steps"].get("decode[4]", 0) > 0  # 3 decode rows padded to 4
    unpadded = dcpgraph.compile(program, backend="eager", block_size=4, capture_limit=0)
    assert unpadded.generate(PROMPTS, 10) == eager_tokens
    assert set(unpadded.report()["graph_steps"]) == {"mixed"}


def test_user_backend_sees_static_decode_shapes(qwen3, eager_tokens):
    _, program = qwen3
    seen = []

    def recording(gm, example_inputs):
        seen.append(tuple(example_inputs[[s.target for s in program.inputs].index("input_ids")].shape))
        return gm

    engine = dcpgraph.compile(program, backend=recording, block_size=4, capture_limit=8)
    assert engine.generate(PROMPTS, 10) == eager_tokens
    assert (1, 4) in seen  # the decode bucket for 3 requests
    assert engine.report()["backend"] == "recording"


def test_unknown_backend_is_a_config_error(qwen3):
    _, program = qwen3
    with pytest.raises(dcpgraph.ConfigError, match="unknown backend"):
        dcpgraph.compile(program, backend="tpu-magic")


def test_emulator_reports_that_it_runs_eagerly():
    model = build_model("llama", dtype=torch.float64)
    engine = dcpgraph.compile(model, tp=2, dcp=2, backend=raise_at_compile, block_size=4)
    assert engine.generate([[1, 2, 3]], 3)
    report = engine.report()
    assert "emulator interprets the graph eagerly" in report["note"]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3", "deepseek_v3"])
def test_inductor_matches_eager(arch):
    """One cold inductor compile per model (~30 s each on 2 cores): the mixed graph only."""
    model = build_model(arch, dtype=torch.float32)
    program = dcpgraph.trace(model)
    prompts = [[1, 2, 3, 4, 5], [6, 7]]
    eager = dcpgraph.compile(program, backend="eager", capture_limit=0).generate(prompts, 6)
    engine = dcpgraph.compile(program, backend="inductor", capture_limit=0)
    assert engine.generate(prompts, 6) == eager
    status = engine.report()["graphs"]["mixed"]
    assert status["backend"] == "inductor" and status["fallback"] is None


def test_unknown_comm_is_refused_before_any_work(monkeypatch):
    import dcpgraph.passes.pipeline as pipeline

    monkeypatch.setattr(pipeline, "compile_program", lambda *a, **k: pytest.fail("compiled anyway"))
    with pytest.raises(dcpgraph.ConfigError, match="comm must be"):
        dcpgraph.compile(build_model("llama"), tp=2, dcp=2, comm="ring")
