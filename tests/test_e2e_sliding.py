"""End-to-end: sliding-window, soft-capped and sink models (:mod:`sliding_models`) give HF
``generate``'s greedy tokens at tp=1 and under DCP (emulated), fp64.

Meshes: tp1·dcp1 (fused context/new read), tp2·dcp2 with a2a and interleave 2, tp4·dcp4 with
ag_rs and interleave 1, tp4·dcp2 with a2a and interleave ``block_size``. Prompts of lengths 1, 3, 11
and 21 with a window of 5 (so most queries see a window that starts inside the context, and on
some ranks excludes the whole local shard), ``max_num_batched_tokens`` 8 (chunked prefill mixed with
decode rows), block size 4, decode buckets on (the default capture limit). Also: prefix caching
with a shared 16-token prefix, and a check per model that its modifiers change HF's tokens (so
the comparison is not vacuous).
"""

from __future__ import annotations

import copy

import pytest
import torch
from sliding_models import (
    BLOCK,
    FEATURES,
    MAX_NEW,
    MODELS,
    PROMPTS,
    WINDOW,
    build,
    compile_options,
    layer_kinds,
)

import dcpgraph
from dcpgraph.testing.generation import drain, hf_greedy

MESHES = [(1, 1, 1, "auto"), (2, 2, 2, "a2a"), (4, 4, 1, "ag_rs"), (4, 2, BLOCK, "a2a")]

_models: dict[str, torch.nn.Module] = {}
_refs: dict[str, list[list[int]]] = {}


def model(name):
    if name not in _models:
        _models[name] = build(name)
    return _models[name]


def reference(name):
    if name not in _refs:
        _refs[name] = [hf_greedy(model(name), p, MAX_NEW) for p in PROMPTS]
    return _refs[name]


def run(name, tp, dcp, interleave, comm, prompts=PROMPTS, **kw):
    engine = dcpgraph.compile(model(name), tp=tp, dcp=dcp, interleave=interleave, comm=comm, block_size=BLOCK,
                              max_num_batched_tokens=8, **compile_options(name, tp), **kw)
    ids = [engine.add_request(list(p), max_new_tokens=MAX_NEW) for p in prompts]
    out = drain(engine)
    return engine, [out[i] for i in ids]


@pytest.mark.parametrize("tp,dcp,interleave,comm", MESHES, ids=[f"tp{m[0]}dcp{m[1]}" for m in MESHES])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_tokens_equal_hf(name, tp, dcp, interleave, comm):
    _, got = run(name, tp, dcp, interleave, comm)
    for prompt, g, want in zip(PROMPTS, got, reference(name)):
        assert g == want, f"{name} ({FEATURES[name]}) tp={tp} dcp={dcp}: prompt of length {len(prompt)}"


def _without_modifiers(name):
    """The same weights with every window widened past any sequence, every cap and sink off."""
    plain = copy.deepcopy(model(name))
    plain.config.sliding_window = 10**6
    for layer in plain.model.layers:
        attn = layer.self_attn
        if getattr(attn, "sliding_window", None):
            attn.sliding_window = 10**6
        if getattr(attn, "attn_logit_softcapping", None):
            attn.attn_logit_softcapping = None
        if hasattr(attn, "sinks"):
            with torch.no_grad():
                attn.sinks.fill_(float("-inf"))
    return plain


@pytest.mark.parametrize("name", sorted(MODELS))
def test_modifiers_change_the_tokens(name):
    assert any(k == f"sliding {WINDOW}" for k in layer_kinds(model(name))), layer_kinds(model(name))
    plain = _without_modifiers(name)
    assert [hf_greedy(plain, p, MAX_NEW) for p in PROMPTS] != reference(name)


@pytest.mark.parametrize("name", ["gemma3_text", "gpt_oss"])
def test_prefix_caching_keeps_tokens(name):
    prefix = tuple(range(20, 36))  # two virtual blocks at dcp=2 (block 4)
    prompts = [prefix + (7, 8, 9), prefix + (50,)]
    want = [hf_greedy(model(name), p, MAX_NEW) for p in prompts]
    engine = dcpgraph.compile(model(name), tp=2, dcp=2, block_size=BLOCK, max_num_batched_tokens=8,
                              enable_prefix_caching=True, **compile_options(name, 2))
    got = []
    for p in prompts:  # one after the other, so the second finds the first's blocks
        rid = engine.add_request(list(p), max_new_tokens=MAX_NEW)
        got.append(drain(engine)[rid])
    assert got == want
    assert engine.report()["prefix_cache"]["hit_tokens"] > 0


def test_explain_names_the_windows():
    program = dcpgraph.trace(model("gemma3_text"))
    from dcpgraph.passes.pipeline import compile_program

    compiled = compile_program(program, dcpgraph.Mesh(2, 2), block_size=BLOCK)
    summaries = " ".join(str(r) for r in compiled.provenance)
    assert f"sliding windows [{WINDOW}]" in summaries


@pytest.mark.parametrize("tp,dcp", [(1, 1), (2, 2)])
def test_speculative_drafts_keep_tokens(tp, dcp):
    """Draft tokens are multi-query rows: the new-token part is windowed causally among them and
    each query's context window starts at its own position (repetitive prompts, so drafts hit)."""
    prompts = [(3, 4, 5, 3, 4, 5, 3, 4, 5, 3, 4), tuple(range(40, 61)) + (40, 41, 42)]
    want = [hf_greedy(model("gemma2"), p, MAX_NEW) for p in prompts]
    engine, got = run("gemma2", tp, dcp, 1, "auto", prompts, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert got == want
    assert engine.report()["speculative"]["accepted"] > 0
