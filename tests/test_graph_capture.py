"""Start-up capture: every graph compiled before the engine takes work, none after.

The mechanism is checked with ``backend="aot_eager"`` (dynamo's guards and recompilations without
inductor's code generation, a few seconds per graph); one slow test runs inductor itself in two
processes sharing a ``compile_cache_dir``.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest
import torch

import dcpgraph
from dcpgraph.models import build_model

PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9], [11, 12, 13], [5] * 20, [7, 8], [3, 1, 4, 1, 5]]


@pytest.fixture(scope="module")
def program():
    return dcpgraph.trace(build_model("qwen3", dtype=torch.float32))


def serve(engine, arrivals):
    """A serving-like run: requests arrive while others run, so decode batches of every size
    and prefill/decode mixes occur. ``arrivals``: step index -> prompts added then."""
    tokens, step = {}, 0
    while step <= max(arrivals) or engine.scheduler.has_work():
        for prompt in arrivals.get(step, []):
            tokens[engine.add_request(prompt, 5)] = []
        for rid, token, _ in engine.step():
            tokens[rid].append(token)
        step += 1
    return [tokens[r] for r in sorted(tokens)]


ARRIVALS = {0: [PROMPTS[0]], 2: PROMPTS[1:3], 3: [PROMPTS[3]], 7: PROMPTS[4:6], 9: PROMPTS[:5]}


@pytest.mark.slow  # ~70 s for both: an aot_eager capture of every bucket, then a serving run
@pytest.mark.parametrize("speculative_tokens", [0, 2])
def test_serving_after_capture_compiles_nothing(program, speculative_tokens, caplog):
    spec = {"method": "ngram", "num_speculative_tokens": speculative_tokens} if speculative_tokens else None
    options = dict(block_size=4, capture_limit=4, max_num_seqs=8, speculative_config=spec)
    with caplog.at_level(logging.INFO, logger="dcpgraph.runtime.capture"):
        engine = dcpgraph.compile(program, backend="aot_eager", **options)
    report = engine.report()["compile"]
    graphs = {"decode[1]", "decode[2]", "decode[4]", "mixed"}
    if speculative_tokens:  # verification steps (1 + k query tokens per row) have their own buckets
        graphs |= {f"verify[{b}x{1 + speculative_tokens}]" for b in (1, 2, 4)}
    assert report["captured"] and set(report["startup_seconds"]) == graphs
    assert all(s > 0 for s in report["startup_seconds"].values())
    assert report["compiles_at_startup"] >= 4  # one per graph at least (dynamo may specialise mixed)
    assert any("captured at start-up" in r.getMessage() and "decode[4]" in r.getMessage() for r in caplog.records)

    eager = dcpgraph.compile(program, backend="eager", **options)
    assert serve(engine, ARRIVALS) == serve(eager, ARRIVALS)
    steps = engine.report()["graph_steps"]
    assert {"decode[1]", "decode[2]", "decode[4]", "mixed"} <= set(steps), steps  # every graph served
    assert not speculative_tokens or any(name.startswith("verify[") for name in steps), steps
    after = engine.report()["compile"]
    assert after["compiles_after_startup"] == 0, after["compiled_after_startup"]
    assert after["compiles_at_startup"] == report["compiles_at_startup"]


def test_capture_leaves_the_cache_untouched(program):
    """Capture rows read no block and write slot -1: every cache is still all zeros."""
    engine = dcpgraph.compile(program, backend=lambda gm, example_inputs: gm, block_size=4, capture_limit=2)
    assert engine.report()["compile"]["compiles_at_startup"] == 3  # decode[1], decode[2], mixed
    for cache in engine.executor.rank_caches(0).values():
        assert not cache.any()


def test_a_compile_after_startup_is_counted(program):
    """The counter can fail: without capture (graphs built lazily) serving compiles each one."""
    from dcpgraph.backends import compile_backend

    engine = dcpgraph.compile(program, backend="eager", block_size=4, capture_limit=2)
    graphs = compile_backend(engine.program, lambda gm, example_inputs: gm, distributed=False)
    graphs.log.mark_started({})  # pretend start-up ended with nothing captured
    engine.executor.graphs = graphs
    engine.generate(PROMPTS[:2], 3)
    report = graphs.report()["compile"]
    served = sorted(engine.report()["graph_steps"])
    assert served == ["decode[2]", "mixed"]
    assert report["compiles_after_startup"] == 2 and report["compiled_after_startup"] == served


def test_eager_and_the_emulator_capture_nothing(program):
    engine = dcpgraph.compile(program, backend="eager", block_size=4)
    assert engine.report()["graphs"] == {}
    emulated = dcpgraph.compile(build_model("llama", dtype=torch.float64), tp=2, dcp=2, backend="aot_eager")
    assert emulated.report()["compile"] == {
        "captured": False, "startup_seconds": {}, "startup_total_seconds": 0, "compiles_at_startup": 0,
        "compiles_after_startup": 0, "compiled_after_startup": [],
    }


def test_compile_cache_dir_is_checked():
    with pytest.raises(dcpgraph.ConfigError, match="compile_cache_dir must be"):
        dcpgraph.compile(build_model("llama"), compile_cache_dir=3)


_INDUCTOR_START = """
import json, sys, time, torch, dcpgraph
from dcpgraph.models import build_model
model = build_model("qwen3", dtype=torch.float32)
start = time.perf_counter()
engine = dcpgraph.compile(model, backend="inductor", capture_limit=2, block_size=4, compile_cache_dir=sys.argv[1])
startup = time.perf_counter() - start
tokens = engine.generate([[1, 2, 3, 4, 5], [6, 7], [8]], 4)
print(json.dumps({"startup": startup, "tokens": tokens, **engine.report()["compile"]}))
"""


@pytest.mark.slow
def test_inductor_start_up_twice_uses_the_cache_dir(program, tmp_path):
    """Two processes with one ``compile_cache_dir``: the second loads the first's compiled graphs
    (inductor's FX graph cache), so its start-up compile is shorter; neither compiles after."""
    runs = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", _INDUCTOR_START, str(tmp_path / "cache")],
                              capture_output=True, text=True, timeout=900, check=True)
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    cold, warm = runs
    eager = dcpgraph.compile(program, backend="eager", capture_limit=2, block_size=4)
    assert cold["tokens"] == warm["tokens"] == eager.generate([[1, 2, 3, 4, 5], [6, 7], [8]], 4)
    assert cold["compiles_after_startup"] == warm["compiles_after_startup"] == 0
    assert warm["startup_total_seconds"] < cold["startup_total_seconds"], (cold, warm)
    assert any((tmp_path / "cache").iterdir())


def test_dynamo_backend_counts_each_recompilation():
    """A static graph meeting a new shape recompiles (guard failure): the counter sees both."""
    from dcpgraph.backends.inductor import compile_dynamo

    gm = torch.fx.symbolic_trace(torch.nn.Linear(4, 2))
    seen = []
    fn = compile_dynamo(gm, [], inner="aot_eager", static=True, on_compile=seen.append)
    x2, x3 = torch.randn(2, 4), torch.randn(3, 4)
    torch.testing.assert_close(fn(x2), gm(x2))
    fn(x2)
    assert len(seen) == 1
    torch.testing.assert_close(fn(x3), gm(x3))
    assert len(seen) == 2 and all(s > 0 for s in seen)
