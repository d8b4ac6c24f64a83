"""Hybrids (qwen3_next: three gated delta net layers, one gated attention layer; lfm2: two
short convolutions around an attention layer) compiled at
tp=1·dcp=1 runs as a program with per-request state pools beside the paged KV cache: two
requests, prompts split into prefill chunks, mixed prefill/decode steps and batched decode rows,
fed HF's own greedy tokens, give HF's logits at every sampled row (so its greedy tokens). (Meshes
with TP and DCP: tests/test_hybrid_mesh.py.) (The engine on top: tests/test_e2e_hybrid.py.)"""

import dataclasses

import pytest
import torch

import dcpgraph
from dcpgraph import Mesh
from dcpgraph.passes.pipeline import compile_program
from dcpgraph.program import CACHE, RANK, RECURRENT, STATE_KINDS
from dcpgraph.runtime.executors import allocate_caches
from dcpgraph.runtime.step_inputs import Chunk, build_step_inputs

transformers = pytest.importorskip("transformers")

from hybrid_models import MODELS  # noqa: E402 - after the transformers check

BLOCK = 4
NEW_TOKENS = 4


# The state pools each model's program must declare: (name, shape per slot, dtype).
POOLS = {
    "qwen3_next": [(f"conv_state_{i}", (2 * 2 * 8 + 4 * 8, 3), torch.float32) for i in range(3)]
    + [(f"recurrent_state_{i}", (4, 8, 8), torch.float32) for i in range(3)],
    "lfm2": [(f"conv_state_{i}", (32, 2), torch.float32) for i in (0, 2)],
}


@pytest.fixture(scope="module", params=[pytest.param("qwen3_next"), pytest.param("lfm2", marks=pytest.mark.slow)])
def arch(request):
    return request.param


@pytest.fixture(scope="module")
def model(arch):
    return MODELS[arch]()


@pytest.fixture(scope="module")
def traced(model):
    return dcpgraph.trace(model)


@pytest.fixture(scope="module")
def program(traced):
    return compile_program(traced, Mesh(1, 1), block_size=BLOCK)


@pytest.mark.slow  # ~50 s on 2 shared cores: trace, verified compile, HF generate, 6 steps
def test_state_pools_and_kv_cache_give_hf_logits_across_chunks_and_decode(arch, model, program):
    assert [(s.name, s.shape, s.dtype) for s in program.recurrent_states] == POOLS[arch]
    shown = dcpgraph.explain(program)
    assert f"%{POOLS[arch][0][0]}: layer" in shown and "one slot per request" in shown
    prompts = {0: [5, 9, 3, 17, 22, 40, 8, 1, 33, 12, 60], 1: [7, 7, 30, 2, 19, 44]}
    full = {}
    with torch.no_grad():
        for r, prompt in prompts.items():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)
            full[r] = out[0].tolist()
            assert len(full[r]) == len(prompt) + NEW_TOKENS
        reference = {r: model(input_ids=torch.tensor([seq])).logits[0] for r, seq in full.items()}
    slots = {0: 2, 1: 0}  # slot 1 stays unused
    tables = {0: tuple(range(0, 5)), 1: tuple(range(5, 8))}
    with_slots = program.replace(lowering=dataclasses.replace(program.lowering, state_slots=3))
    caches = allocate_caches(with_slots, 10, torch.device("cpu"))  # its zeroed pools are replaced just below
    pools = {s.name: torch.full((3, *s.shape), float("nan"), dtype=s.dtype) for s in program.recurrent_states}
    state = program.local_state(0)
    # (request, start, end) per row: prefill chunks, a mixed step, then batched decode rows.
    steps = [[(0, 0, 5)], [(0, 5, 10), (1, 0, 4)], [(0, 10, 11), (1, 4, 6)]]
    steps += [[(0, 11 + i, 12 + i), (1, 6 + i, 7 + i)] for i in range(NEW_TOKENS - 1)]
    checked = greedy = 0
    for rows in steps:
        chunks = [Chunk(r, tuple(full[r][s:e]), s, tables[r]) for r, s, e in rows]
        shared, per_rank = build_step_inputs(chunks, program.mesh, BLOCK, 1)
        shared["state_slots"] = torch.tensor([slots[r] for r, _, _ in rows], dtype=torch.int64)
        values = {**shared, **per_rank[0]}
        args, weights = [], iter(state)
        for spec in program.inputs:
            if spec.kind in STATE_KINDS:
                args.append(next(weights))
            elif spec.kind == CACHE:
                args.append(caches[spec.name])
            elif spec.kind == RECURRENT:
                args.append(pools[spec.name])
            else:
                assert spec.kind != RANK or spec.target in values
                args.append(values[spec.target])
        with torch.no_grad():
            out = program.graph_module(*args)
        logits = (out[0] if isinstance(out, (tuple, list)) else out)[0]
        for i, (r, _, end) in enumerate(rows):
            torch.testing.assert_close(logits[i], reference[r][end - 1], atol=1e-4, rtol=1e-4)
            if len(prompts[r]) <= end < len(full[r]):  # the next token HF generated is this row's argmax
                assert int(logits[i].argmax()) == full[r][end]
                greedy += 1
            checked += 1
    assert checked == 1 + 2 * (len(steps) - 1) and greedy == 2 * NEW_TOKENS
    assert all(torch.isnan(p[1]).all() for p in pools.values())  # the unused slot was never written
