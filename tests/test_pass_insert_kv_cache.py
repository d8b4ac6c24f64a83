"""``insert_kv_cache`` on its own: ops before/after, the inputs it adds, and the numbers.

Model: ``build_model("llama")`` in fp32 (2 layers, 8 query heads, 1 KV head, head dim 8). The
numbers are checked against the program *before* the pass (canonical attention over the whole
sequence): a prefill chunk, then a step that mixes a continuing chunk of request A (reading its
first chunk back from the cache) with the whole prompt of request B, must give the same logits
rows as running each full sequence at once.
"""

from __future__ import annotations

import collections

import pytest
import torch

import dcpgraph
from dcpgraph.errors import PassOrderError
from dcpgraph.models import build_model
from dcpgraph.passes.insert_kv_cache import META_ROLES, insert_kv_cache
from dcpgraph.passes.manager import run_passes
from dcpgraph.program import CACHE, META, STATE_KINDS

BLOCK = 4
LAYERS, KV_HEADS, HEAD_DIM = 2, 1, 8
dcp_ops = torch.ops.dcpgraph


def op_counts(program) -> collections.Counter:
    return collections.Counter(n.target for n in program.graph_module.graph.nodes if n.op == "call_function")


@pytest.fixture(scope="module")
def stages():
    traced = dcpgraph.trace(build_model("llama", dtype=torch.float32, layers=LAYERS))
    after = run_passes(traced, [insert_kv_cache.with_options(block_size=BLOCK)])
    return traced, after


def test_ops_before_and_after(stages):
    before, after = stages
    b, a = op_counts(before), op_counts(after)
    assert (b[dcp_ops.attention.default], b[dcp_ops.paged_attention.default], b[dcp_ops.kv_cache_write_.default]) \
        == (LAYERS, 0, 0)
    # per layer: two cache writes (k, v), one paged read of the context, one causal attention over
    # the new tokens, one LSE merge of the two
    assert a[dcp_ops.attention.default] == 0
    assert a[dcp_ops.kv_cache_write_.default] == 2 * LAYERS
    assert a[dcp_ops.paged_attention.default] == a[dcp_ops.partial_attention.default] == LAYERS
    assert a[dcp_ops.merge_attention.default] == LAYERS
    # nothing else in the model changed
    untouched = {t for t in b if getattr(t, "namespace", None) == "aten" and t not in (
        torch.ops.aten.transpose.int, torch.ops.aten.select.int, torch.ops.aten.unsqueeze.default)}
    assert {t: a[t] for t in untouched} == {t: b[t] for t in untouched}


def test_inputs_caches_and_outputs(stages):
    before, after = stages
    cache_names = [f"{role}_cache_{layer}" for layer in range(LAYERS) for role in ("k", "v")]
    assert [s.name for s in after.inputs] == [s.name for s in before.inputs] + cache_names + list(META_ROLES)
    assert [s.name for s in after.inputs_of(CACHE)] == cache_names
    assert [(s.name, s.target) for s in after.inputs_of(META)] == [(r, r) for r in META_ROLES]
    assert [(c.name, c.layer, c.role, c.heads, c.dim) for c in after.caches] == [
        (f"{role}_cache_{layer}", layer, role, KV_HEADS, HEAD_DIM) for layer in range(LAYERS) for role in ("k", "v")
    ]
    assert after.lowering.block_size == BLOCK and not before.caches
    assert after.state is before.state  # no state added or dropped
    out = next(n for n in reversed(after.graph_module.graph.nodes) if n.op == "output").args[0]
    assert [n.name for n in out[1:]] == cache_names  # caches returned (donated, written in place)


def test_requires_canonical_attention(stages):
    _, after = stages
    with pytest.raises(PassOrderError, match=r"pass 'insert_kv_cache' requires canonical dcpgraph.attention nodes"):
        run_passes(after, [insert_kv_cache])


def _step(program, caches, ids, positions, cu, context, table, slots) -> torch.Tensor:
    values = {
        "input_ids": torch.tensor([ids]), "position_ids": torch.tensor([positions]),
        "cu_seqlens_q": torch.tensor(cu, dtype=torch.int32), "context_lens": torch.tensor(context, dtype=torch.int32),
        "block_table": torch.tensor(table, dtype=torch.int32), "slot_mapping": torch.tensor(slots),
    }
    args = []
    for spec in program.inputs:
        if spec.kind in STATE_KINDS:
            args.append(program.state[spec.target])
        elif spec.kind == CACHE:
            args.append(caches[spec.name])
        else:
            args.append(values[spec.target])
    with torch.no_grad():
        return program.graph_module(*args)[0][0]


def _full(program, ids) -> torch.Tensor:
    args = [program.state[s.target] if s.kind in STATE_KINDS
            else torch.tensor([ids]) if s.target == "input_ids" else torch.arange(len(ids)).unsqueeze(0)
            for s in program.inputs]
    with torch.no_grad():
        return program.graph_module(*args)[0][0]


def test_cached_steps_equal_the_whole_sequence(stages):
    before, after = stages
    gen = torch.Generator().manual_seed(0)
    a = torch.randint(1, 256, (7,), generator=gen).tolist()
    b = torch.randint(1, 256, (2,), generator=gen).tolist()
    caches = {c.name: torch.zeros(4, BLOCK, c.heads, c.dim) for c in after.caches}
    # request A owns blocks 0, 1; request B block 2. slot = block · BLOCK + offset
    first = _step(after, caches, a[:4], [0, 1, 2, 3], [0, 4], [0], [[0, 1]], [0, 1, 2, 3])
    mixed = _step(after, caches, a[4:] + b, [4, 5, 6, 0, 1], [0, 3, 5], [4, 0], [[0, 1], [2, 0]], [4, 5, 6, 8, 9])
    full_a, full_b = _full(before, a), _full(before, b)
    torch.testing.assert_close(first, full_a[:4], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mixed[:3], full_a[4:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mixed[3:], full_b, atol=1e-5, rtol=1e-5)
    assert caches["k_cache_0"][3].abs().sum() == 0  # block 3 was never written
