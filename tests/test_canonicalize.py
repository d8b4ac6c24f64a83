"""Attention canonicalization, one job at a time (the whole pass on models: tests/test_frontends.py).

1. patterns: the traced score patterns, and what the anchored matcher binds (op families, either
   operand order for add/mul, literals not compared, one host node per pattern node);
2. gqa: ``unrepeat`` / ``kv_sources`` / ``untranspose`` on traced graphs;
3. masks: ``causal_problem`` against hand-built masks of each kind, and ``MaskEvaluator`` cutting
   a mask out of an exported graph and evaluating it at concrete token counts.

Small graphs come from ``make_fx(pre_dispatch=True)``, the aten IR ``torch.export`` produces;
mask evaluation needs a Program, so those models go through the export front end (without the
canonicalize pass, which would consume the masks).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
from torch.fx.experimental.proxy_tensor import make_fx

from dcpgraph.errors import UnsupportedModelError
from dcpgraph.frontends import canonicalize as canon
from dcpgraph.frontends import export as export_mod
from dcpgraph.frontends.canonicalize.masks import MaskRefusal, check_causal
from dcpgraph.frontends.canonicalize.patterns import SOFTMAX
from dcpgraph.program import ModelFacts

aten = torch.ops.aten
NEG_INF = float("-inf")
VOCAB, HIDDEN, HEADS, KV_HEADS = 64, 32, 4, 2


def graph_of(fn, *examples) -> torch.fx.Graph:
    return make_fx(fn, pre_dispatch=True)(*examples).graph


def first(graph: torch.fx.Graph, targets) -> torch.fx.Node:
    targets = targets if isinstance(targets, frozenset) else {targets}
    return next(n for n in graph.nodes if n.op == "call_function" and n.target in targets)


def placeholders(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    return [n for n in graph.nodes if n.op == "placeholder"]


Q, KT = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 8, 4)
BOOL_MASK, FLOAT_MASK = torch.zeros(4, 4, dtype=torch.bool), torch.zeros(4, 4)


# -- 1. patterns ---------------------------------------------------------------------------------------
def test_patterns_are_every_scale_and_mask_step_most_ops_first():
    patterns = canon.score_patterns()
    assert canon.score_patterns() is patterns  # traced once per process
    names = {p.name for p in patterns}
    assert names == {
        f"{scale}{mask}"
        for scale in ("mul-scaled ", "div-scaled ", "")
        for mask in ("masked_fill", "additive", "where", "unmasked")
    }
    sizes = [p.num_ops for p in patterns]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] == 4 and sizes[-1] == 2
    for p in patterns:  # the traced softmax is the root every match is anchored on
        assert p.root.target is aten.softmax.int and p.roles[p.root] == "softmax"


# name of the pattern expected, score function, example mask
MATCHES = [
    ("div-scaled masked_fill",
     lambda q, kT, m: torch.softmax((q @ kT / 8.0).masked_fill(m, NEG_INF), -1), BOOL_MASK),
    ("mul-scaled additive",  # the mask first: add's operands match in either order
     lambda q, kT, m: torch.softmax(m + torch.matmul(q, kT) * 0.3, -1), FLOAT_MASK),
    ("where",  # a finite fill is a literal: matched here, judged by the mask check
     lambda q, kT, m: torch.softmax(torch.where(m, q @ kT, -1e9), -1), BOOL_MASK),
    ("masked_fill",  # another softmax of the family
     lambda q, kT, m: torch.ops.aten._softmax((q @ kT).masked_fill(m, NEG_INF), -1, False), BOOL_MASK),
    ("mul-scaled unmasked", lambda q, kT, m: torch.softmax((q @ kT).mul(0.5), -1) + 0 * m, FLOAT_MASK),
]


@pytest.mark.parametrize(("name", "fn", "mask"), MATCHES, ids=[m[0] for m in MATCHES])
def test_match_binds_every_role(name, fn, mask):
    graph = graph_of(fn, Q, KT, mask)
    softmax = first(graph, SOFTMAX)
    matched = canon.match_scores(softmax)
    assert matched is not None and matched.pattern.name == name
    q, kT, m = placeholders(graph)
    roles = matched.roles
    assert (roles["q"], roles["kT"], roles["softmax"]) == (q, kT, softmax)
    assert roles["qk"].target is aten.matmul.default
    assert ("mask" in roles) == (matched.pattern.mask is not None)
    if "mask" in roles:
        scores = roles.get("scale", roles["qk"])
        assert roles["mask"] is m and {m, scores} <= set(roles["masked"].args)
    assert ("scale" in roles) == (matched.pattern.scale is not None)


REFUSED = [
    ("soft-capping", lambda q, kT, m: torch.softmax(torch.tanh(q @ kT / 30.0) * 30.0, -1)),
    ("a bias before the scale", lambda q, kT, m: torch.softmax((q @ kT + 1.0) * 0.5, -1)),
    # q @ q: one host node cannot be both q and kT (bindings are one-to-one)
    ("one node as q and kT", lambda q, kT, m: torch.softmax(torch.matmul(q, q), -1)),
    # divisions match the scores as numerator only
    ("a constant over the scores", lambda q, kT, m: torch.softmax(torch.div(m, q @ kT), -1)),
]


@pytest.mark.parametrize(("why", "fn"), REFUSED, ids=[r[0] for r in REFUSED])
def test_match_finds_nothing(why, fn):
    graph = graph_of(fn, torch.randn(1, 2, 4, 4), torch.randn(1, 2, 4, 4), torch.ones(4, 4))
    assert canon.match_scores(first(graph, SOFTMAX)) is None


def test_match_is_anchored_on_the_softmax():
    graph = graph_of(lambda q, kT: torch.softmax(q @ kT, -1), Q, KT)
    assert canon.match_scores(first(graph, aten.matmul.default)) is None
    assert canon.match_scores(first(graph, SOFTMAX)).pattern.name == "unmasked"


def test_only_softmaxes_that_reach_a_matmul_are_attention():
    def fn(q, kT, v, router):
        p = torch.softmax(q @ kT, -1).to(torch.float64).to(torch.float32)
        return p @ v, torch.softmax(router, -1)  # the second softmax (a router) is not attention

    graph = graph_of(fn, Q, KT, torch.randn(1, 2, 4, 8), torch.randn(3, 5))
    found = canon.attention_softmaxes(graph)
    assert len(found) == 1 and found[0][1].target is aten.matmul.default
    assert canon.raw_attention(graph) == [found[0][0]]


# -- 2. gqa --------------------------------------------------------------------------------------------
KV = torch.randn(1, 2, 4, 8)


def test_unrepeat_sees_through_repeat_interleave_on_the_head_dim_only():
    graph = graph_of(lambda k: (k.repeat_interleave(3, dim=1), k.repeat_interleave(3, dim=2)), KV)
    (k,) = placeholders(graph)
    heads, tokens = [n for n in graph.nodes if n.target is aten.repeat_interleave.self_int]
    assert canon.unrepeat(heads) == (k, 3)
    assert canon.unrepeat(tokens) == (tokens, 1)
    assert canon.unrepeat(k) == (k, 1)


def test_unrepeat_sees_through_hf_repeat_kv():
    def repeat_kv(k):
        b, h, s, d = k.shape
        return k[:, :, None, :, :].expand(b, h, 3, s, d).reshape(b, h * 3, s, d)

    def repeat_tokens(k):  # expand on the token dim: not a head repeat
        b, h, s, d = k.shape
        return k[:, :, :, None, :].expand(b, h, s, 3, d).reshape(b, h, s * 3, d)

    graph = graph_of(repeat_kv, KV)
    (k,) = placeholders(graph)
    assert canon.unrepeat(first(graph, aten.reshape.default)) == (k, 3)
    other = first(graph_of(repeat_tokens, KV), aten.reshape.default)
    assert canon.unrepeat(other) == (other, 1)


def test_kv_sources_undo_only_a_repeat_k_and_v_share():
    def fn(k, v):
        return k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), v.repeat_interleave(4, 1)

    graph = graph_of(fn, KV, KV.clone())  # distinct tensors: make_fx keys placeholders by tensor
    k, v = placeholders(graph)
    k2, v2, v4 = [n for n in graph.nodes if n.target is aten.repeat_interleave.self_int]
    assert canon.kv_sources(k2, v2) == (k, v)
    assert canon.kv_sources(k2, v4) == (k2, v4)


def test_untranspose_accepts_only_a_swap_of_the_last_two_dims():
    def fn(k):
        return k.transpose(-2, -1), k.transpose(2, 3), k.mT, k.permute(0, 1, 3, 2), k.transpose(1, 2), k.permute(1, 0, 3, 2)

    graph = graph_of(fn, KV)
    (k,) = placeholders(graph)
    outs = next(n for n in graph.nodes if n.op == "output").args[0]
    assert [canon.untranspose(n) for n in outs] == [k, k, k, k, None, None]
    assert canon.untranspose(k) is None


# -- 3. masks ------------------------------------------------------------------------------------------
T = 5
TRIL = torch.ones(T, T, dtype=torch.bool).tril()
SCORES = (1, 2, T, T)
ADDITIVE = torch.zeros(T, T).masked_fill(~TRIL, NEG_INF)

CAUSAL = [
    ("masked_fill", ~TRIL, NEG_INF),
    ("masked_fill", ~TRIL[None, None], -1e9),  # broadcast; -1e9 is as good as -inf
    ("where", TRIL, torch.finfo(torch.float32).min),
    ("additive", ADDITIVE, None),
    ("additive", torch.zeros(T, T).masked_fill(~TRIL, -1e30), None),
    ("sdpa", TRIL, None),
    ("sdpa", ADDITIVE, None),  # a float SDPA mask is additive
]


@pytest.mark.parametrize(("kind", "mask", "fill"), CAUSAL, ids=[f"{c[0]}-{i}" for i, c in enumerate(CAUSAL)])
def test_causal_masks_pass(kind, mask, fill):
    assert canon.causal_problem(kind, mask, SCORES, fill) is None


NOT_CAUSAL = [
    ("masked_fill", ~TRIL, -1e4, "needs -inf"),
    ("masked_fill", (~TRIL).float(), NEG_INF, "masked_fill with a torch.float32 mask"),
    ("where", ~TRIL, NEG_INF, "see later positions"),  # the condition keeps, it does not drop
    ("additive", ADDITIVE + torch.arange(T).float(), None, "position bias such as ALiBi"),
    ("additive", TRIL, None, "additive mask of dtype torch.bool"),
    ("sdpa", torch.ones(T, T, dtype=torch.bool), None, "masks nothing"),
    ("sdpa", TRIL & ~torch.ones(T, T, dtype=torch.bool).tril(-2), None, "hides positions"),
    ("masked_fill", ~TRIL[:3], NEG_INF, "does not broadcast"),
    ("masked_fill", 1.0, NEG_INF, "is a float, not a tensor"),
]


@pytest.mark.parametrize(("kind", "mask", "fill", "problem"), NOT_CAUSAL, ids=[c[3] for c in NOT_CAUSAL])
def test_other_masks_are_named(kind, mask, fill, problem):
    assert problem in canon.causal_problem(kind, mask, SCORES, fill)


def test_rectangular_scores_are_not_causal():
    assert "not square" in canon.causal_problem("sdpa", TRIL[:3], (1, 1, 3, T))


class MaskedScores(nn.Module):
    """One GQA attention by hand; ``mask`` picks where the mask comes from."""

    def __init__(self, mask: str):
        super().__init__()
        self.mask, self.hd = mask, HIDDEN // HEADS
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.q = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.kv = nn.Linear(HIDDEN, 2 * KV_HEADS * self.hd, bias=False)
        self.register_buffer("tril", torch.ones(64, 64, dtype=torch.bool).tril(), persistent=False)

    def forward(self, input_ids, position_ids):
        x = self.emb(input_ids)
        b, t, _ = x.shape
        q = self.q(x).view(b, t, HEADS, self.hd).transpose(1, 2)
        k, v = self.kv(x).view(b, t, 2 * KV_HEADS, self.hd).transpose(1, 2).chunk(2, dim=1)
        k, v = k.repeat_interleave(HEADS // KV_HEADS, 1), v.repeat_interleave(HEADS // KV_HEADS, 1)
        if self.mask == "buffer":
            hidden = ~self.tril[:t, :t]
        else:  # read from the values of position_ids: causal only for increasing positions
            hidden = position_ids[0, None, :] > position_ids[0, :, None]
        s = (q @ k.transpose(-2, -1) / math.sqrt(self.hd)).masked_fill(hidden, NEG_INF)
        return torch.softmax(s, -1) @ v


def exported(model: nn.Module, dynamic: bool = True):
    """The ``trace`` Program of ``model`` (canonicalize not run)."""
    ids, positions = torch.arange(6)[None] % VOCAB, torch.arange(6)[None]
    shapes = ({1: torch.export.Dim.DYNAMIC}, {1: torch.export.Dim.DYNAMIC}) if dynamic else None
    with torch.no_grad():
        ep, _ = export_mod.run_export(model.eval(), (ids, positions), shapes)
    facts = ModelFacts(architecture="MaskedScores", attention="gqa", num_layers=0, num_q_heads=0,
                       num_kv_heads=0, head_dim=0, v_head_dim=0, vocab_size=0, hidden_size=0)
    return export_mod.program_from_export(ep, facts)


@pytest.fixture(scope="module")
def traced():
    torch.manual_seed(0)
    return {
        "buffer": exported(MaskedScores("buffer")),
        "positions": exported(MaskedScores("positions")),
        "static": exported(MaskedScores("buffer"), dynamic=False),
    }


def _masked_fill(program) -> torch.fx.Node:
    return first(program.graph_module.graph, aten.masked_fill.Scalar)


def test_a_buffer_mask_evaluates_to_the_causal_mask_at_each_token_count(traced):
    program = traced["buffer"]
    masks = canon.MaskEvaluator(program, program.graph_module)
    counts = masks.token_counts()
    assert len(counts) == 2 and all(isinstance(t, int) and t >= 2 for t in counts)
    masked = _masked_fill(program)
    for tokens in counts:
        hidden = masks.evaluate(masked.args[1], tokens)
        assert torch.equal(hidden, ~torch.ones(tokens, tokens, dtype=torch.bool).tril())
        assert masks.shape(masked, tokens) == (1, HEADS, tokens, tokens)
    check_causal(masks, masked, "masked_fill", masked.args[1], masked, masked.args[2])  # no error


def test_a_static_trace_is_evaluated_as_traced(traced):
    program = traced["static"]
    masks = canon.MaskEvaluator(program, program.graph_module)
    assert masks.token_counts() == (None,)
    masked = _masked_fill(program)
    assert masks.evaluate(masked.args[1], None).shape == (6, 6)


def test_a_mask_from_input_values_is_refused_with_its_location(traced):
    program = traced["positions"]
    masks = canon.MaskEvaluator(program, program.graph_module)
    masked = _masked_fill(program)
    with pytest.raises(MaskRefusal, match="computed from the values of input 'position_ids'"):
        masks.evaluate(masked.args[1], 5)
    with pytest.raises(UnsupportedModelError, match=r"node masked_fill: the attention mask .* "
                       r"computed from the values of input 'position_ids'"):
        check_causal(masks, masked, "masked_fill", masked.args[1], masked, masked.args[2])


def test_the_exported_hand_written_attention_matches_with_its_gqa_repeat(traced):
    graph = traced["buffer"].graph_module.graph
    matched = canon.match_scores(first(graph, SOFTMAX))
    assert matched.pattern.name == "div-scaled masked_fill"
    assert {r: n.target for r, n in matched.roles.items() if r not in ("q", "kT", "mask")} == {
        "qk": aten.matmul.default, "scale": aten.div.Tensor,
        "masked": aten.masked_fill.Scalar, "softmax": aten.softmax.int,
    }
    k = canon.untranspose(matched.roles["kT"])
    assert k.target is aten.repeat_interleave.self_int
    source, reps = canon.unrepeat(k)
    assert reps == HEADS // KV_HEADS and source.meta["val"].shape[1] == KV_HEADS
    assert "MaskedScores" in canon.describe_location(matched.roles["softmax"])
