"""``respecialize_shapes``: shape literals a trace baked in follow the input sizes a pass changed.

Each case is a one-op graph whose input was traced at ``original`` shape (its ``meta["val"]``)
and now arrives at ``current`` shape; the expected literal is worked out by hand from the rule in
the module docstring. The last test runs the real thing: DeepSeek's rope reshape under TP.
"""

from __future__ import annotations

import pytest
import torch
import torch.fx

import dcpgraph
from dcpgraph.models import build_model
from dcpgraph.passes.pipeline import compile_program
from dcpgraph.passes.respecialize import respecialize_shapes

aten = torch.ops.aten


def one_op(target, original: tuple[int, ...], shape: list, *extra) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(original, device="meta")
    graph.output(graph.call_function(target, (x, shape, *extra)))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def shape_arg(gm: torch.fx.GraphModule) -> list:
    (node,) = [n for n in gm.graph.nodes if n.op == "call_function"]
    return list(node.args[1])


@pytest.mark.parametrize(
    ("target", "original", "current", "shape", "expected", "fixed"),
    [
        # position rule: the literal sits where the input's sharded size sits
        (aten.view.default, (1, 8, 6, 16), (1, 4, 6, 16), [1, 8, 6, -1, 2], [1, 4, 6, -1, 2], 1),
        (aten.new_zeros.default, (1, 8, 6, 16), (1, 2, 6, 16), [1, 8, 6, 16], [1, 2, 6, 16], 1),
        (aten.expand.default, (1, 8, 6, 16), (1, 4, 6, 16), [1, 8, 6, 16], [1, 4, 6, 16], 1),
        # element-count rule: heads moved to the front; 8 heads shrank to 4, so 8 -> 4
        (aten.reshape.default, (1, 8, 6, 16), (1, 4, 6, 16), [8, 96], [4, 96], 1),
        # nothing changed: nothing is touched, even a literal equal to an input size
        (aten.view.default, (1, 8, 6, 16), (1, 8, 6, 16), [1, 8, 96], [1, 8, 96], 0),
        # -1 absorbs the change already
        (aten.view.default, (1, 6, 64), (1, 6, 32), [1, 6, -1, 8], [1, 6, -1, 8], 0),
        # last-dim split rule: a hard-coded head count (OPT's view(bsz, -1, num_heads, head_dim)),
        # heads == head_dim, so only the position (the outer factor) says which one shrank
        (aten.view.default, (1, 6, 64), (1, 6, 16), [1, -1, 8, 8], [1, -1, 2, 8], 1),
        # a per-head fused qkv (Persimmon's [heads, 3, head_dim] rows)
        (aten.view.default, (1, 6, 192), (1, 6, 48), [1, 6, 8, 3, 8], [1, 6, 2, 3, 8], 1),
    ],
)
def test_realigns_literals(target, original, current, shape, expected, fixed):
    gm = one_op(target, original, shape)
    assert respecialize_shapes(gm, [(current, torch.float32)]) == fixed
    assert shape_arg(gm) == expected


def test_element_count_rule_refuses_to_guess():
    """[1, 6, 8, 16] -> [1, 6, 128] with 8 heads now 4: no literal equals the shrunk size 8, so the
    shape stays, and running it fails loudly, instead of halving the token literal 6."""
    gm = one_op(aten.view.default, (1, 6, 8, 16), [1, 6, 128])
    with pytest.raises(RuntimeError, match=r"shape '\[1, 6, 128\]' is invalid for input of size 384"):
        respecialize_shapes(gm, [((1, 6, 4, 16), torch.float32)])
    assert shape_arg(gm) == [1, 6, 128]
    # two literals equal to the shrunk size: ambiguous, left alone
    gm = one_op(aten.reshape.default, (1, 8, 6, 8), [8, 6, 8])
    with pytest.raises(RuntimeError, match="invalid for input of size 192"):
        respecialize_shapes(gm, [((1, 4, 6, 8), torch.float32)])
    assert shape_arg(gm) == [8, 6, 8]


def test_later_literals_follow_earlier_fixes():
    """A second reshape reads the first one's *current* (fixed) size, not its traced one."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(1, 8, 6, 16, device="meta")
    a = graph.call_function(aten.view.default, (x, [1, 8, 6, 16]))
    a.meta["val"] = torch.empty(1, 8, 6, 16, device="meta")
    b = graph.call_function(aten.reshape.default, (a, [1, 8, 96]))
    graph.output(b)
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    assert respecialize_shapes(gm, [((1, 4, 6, 16), torch.float32)]) == 2
    assert [list(n.args[1]) for n in (a, b)] == [[1, 4, 6, 16], [1, 4, 96]]
    gm.recompile()  # like shard_tp, the caller regenerates the code after the edit
    out = gm(torch.randn(1, 4, 6, 16))
    assert out.shape == (1, 4, 96)


def test_deepseek_rope_reshape_is_respecialised_under_tp():
    """HF DeepSeek's rope does ``q.reshape(b, h, s, d // 2, 2)`` with the head count h frozen in."""
    program = dcpgraph.trace(build_model("deepseek_v2", dtype=torch.float32, layers=1))
    for tp in (2, 4):
        out = compile_program(program, dcpgraph.Mesh(tp, 1), block_size=4)
        summary = out.stage("shard_tp").provenance[-1].summary
        assert summary.endswith("1 baked-in shape literals re-specialised"), summary
        views = [
            n for n in out.stage("shard_tp").graph_module.graph.nodes
            if n.target is aten.reshape.default and len(n.args[1]) == 5 and n.args[1][-1] == 2
        ]
        # the queries' 8 heads became 8 // tp; the shared rope key keeps its single head
        assert [v.args[1][1] for v in views] == [8 // tp, 1]
    assert compile_program(program, dcpgraph.Mesh(1, 1), block_size=4).stage("shard_tp").provenance[-1].summary \
        == "tp=1: nothing to shard"
