"""``EngineClient``: the one interface serving calls, implemented by the in-process ``Engine`` and the
worker group ``RemoteEngine`` (its gloo run is in ``tests/test_llm.py``'s tp2/dcp2 workers test).

Checked here: both implement it; an in-process engine runs rank ops on its one rank, refuses an
unknown one naming the known ones, and reports cache use per rank from its block manager; and the
serving layer never asks which implementation it holds (no ``isinstance``/``getattr`` probes on
an engine), so a third implementation needs no change there.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import dcpgraph
from dcpgraph.models import build_model
from dcpgraph.runtime.engine import Engine
from dcpgraph.runtime.engine_client import RANK_OPS, EngineClient, register_rank_op
from dcpgraph.serving.kv_connector import rank_ops
from dcpgraph.serving.workers import RemoteEngine

SERVING = Path(dcpgraph.__file__).parent / "serving"


def test_both_engines_implement_the_client():
    assert issubclass(Engine, EngineClient) and issubclass(RemoteEngine, EngineClient)
    assert not EngineClient.__abstractmethods__ - set(vars(Engine)) - set(vars(EngineClient))
    assert not EngineClient.__abstractmethods__ - set(vars(RemoteEngine)) - set(vars(EngineClient))


def test_in_process_rank_ops_and_cache_use():
    engine = dcpgraph.compile(build_model("llama"), tp=2, dcp=2, block_size=4, num_blocks=16)
    register_rank_op("test.blocks", lambda e, extra: e.blocks.num_blocks + extra)
    try:
        assert engine.rank_call("test.blocks", {"extra": 1}) == [17]
        with pytest.raises(ValueError, match=r"unknown rank op 'nope'; known: \[.*'test.blocks'"):
            engine.rank_call("nope", {})
    finally:
        RANK_OPS.pop("test.blocks")
    assert all(f"kv.{name}" in RANK_OPS for name in rank_ops.OPS)  # the KV transfer's steps
    assert engine.kv_usage_per_rank() == [(0, 16), (0, 16)]
    rid = engine.add_request([1, 2, 3, 4, 5], 4)
    engine.step()
    used = engine.kv_usage_per_rank()
    assert used[0][0] > 0 and used[0] == used[1]
    engine.abort(rid)
    assert engine.kv_usage_per_rank() == [(0, 16), (0, 16)] and engine.healthy()


def engine_probes(root: Path) -> list[str]:
    """``file:line`` of every ``isinstance(<...engine...>, ...)`` or ``getattr(<...engine...>, ...)``
    under ``root``: code that asks which engine it holds."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("isinstance", "getattr", "hasattr") and node.args
                    and "engine" in ast.unparse(node.args[0]).lower()):
                found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def test_serving_never_asks_which_engine_it_holds(tmp_path):
    assert engine_probes(SERVING) == []
    (tmp_path / "x.py").write_text("def f(self):\n    return getattr(self.engine, 'procs', None)\n")
    assert engine_probes(tmp_path) == ["x.py:2"]
