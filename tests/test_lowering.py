"""``Program.lowering``: what the passes decided, as typed fields, never a string-keyed dict.

Each field is unset until the pass that decides it has run, then read by later passes and the
runtime as an attribute. A scan of the package finds any ``.options[...]`` / ``.options.get(...)``
read (the string-keyed form this replaced).
"""

from __future__ import annotations

import ast
from pathlib import Path

import dcpgraph
from dcpgraph.models import build_model
from dcpgraph.program import Lowering

PACKAGE = Path(dcpgraph.__file__).parent


def test_each_pass_sets_what_it_decides():
    traced = dcpgraph.trace(build_model("llama"))
    assert traced.lowering == Lowering() and traced.lowering.items() == [("interleave", 1)]
    engine = dcpgraph.compile(traced, tp=2, dcp=2, interleave=2, block_size=4, comm="a2a")
    program = engine.program
    assert program.stage("insert_kv_cache").lowering.block_size == 4
    assert program.stage("absorb_mla").lowering.block_size is None
    assert program.stage("shard_tp").lowering.comm is None and program.lowering.comm == "a2a"
    assert (program.lowering.interleave, program.lowering.kv_cache_dtype, program.lowering.new_tokens) == \
        (2, "auto", "fused")
    assert program.lowering.comm_choice is None  # comm was given, not chosen
    assert program.lowering.sliding_caches == () and program.lowering.hidden_states_output is None
    assert "# lowering: block_size=4, comm=a2a, interleave=2" in dcpgraph.explain(program)


def string_keyed_reads(root: Path) -> list[str]:
    """``file:line`` of every ``<x>.options[...]`` or ``<x>.options.get(...)`` under ``root``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            target = node.value if isinstance(node, ast.Subscript) else \
                node.func.value if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr == "get" else None
            if isinstance(target, ast.Attribute) and target.attr == "options":
                found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def test_nothing_reads_a_string_keyed_options_dict(tmp_path):
    assert string_keyed_reads(PACKAGE) == []
    (tmp_path / "x.py").write_text("def f(p):\n    return p.options['block_size'], p.options.get('comm')\n")
    assert string_keyed_reads(tmp_path) == ["x.py:2", "x.py:2"]
