"""``dcpgraph.rotary_embedding`` and the ``native_rotary`` pass (:mod:`dcpgraph.ops.rotary`).

The native kernel is checked against eager torch's own op sequence (the op's meaning): equal bit
for bit in bf16, fp16 and fp32, so an engine's logits are the same with and without the pass.
Kernel tests skip, naming why, where it cannot be built.
"""

from __future__ import annotations

import pytest
import torch

import dcpgraph
from dcpgraph.ops import library, rotary
from dcpgraph.testing.checkpoints import tiny_model
from dcpgraph.testing.generation import record_logits

OP = "dcpgraph.rotary_embedding.default"


def _need_native():
    if not rotary.native_enabled():
        pytest.skip(f"native rotary kernel unavailable: {rotary.reason()}")


@pytest.mark.parametrize("dtype", rotary.DTYPES)
@pytest.mark.parametrize(
    "x_shape, cs_shape, transposed",
    [((1, 16, 1, 64), (1, 1, 1, 64), True),    # decode: one token, heads from a transposed view
     ((1, 4, 7, 128), (1, 1, 7, 128), True),   # a prefill chunk
     ((2, 3, 5, 32), (2, 1, 5, 32), False),    # a batch dim, contiguous
     ((1, 2, 3, 6), (3, 6), False)],           # cos/sin of fewer dims
)
def test_op_equals_eager_torch_bit_for_bit(x_shape, cs_shape, transposed, dtype):
    _need_native()
    gen = torch.Generator().manual_seed(sum(x_shape))
    b, h, t, d = x_shape
    x = (8 * torch.randn(b, t, h, d, generator=gen)).to(dtype).transpose(1, 2) if transposed else \
        (8 * torch.randn(x_shape, generator=gen)).to(dtype)
    cos, sin = (torch.randn(cs_shape, generator=gen).to(dtype) for _ in range(2))
    got = library.rotary_embedding(x, cos, sin)
    want = rotary.rotary_reference(x, cos, sin)
    assert got.dtype == dtype and got.shape == want.shape
    assert torch.equal(got, want)


def test_other_inputs_take_eager_torch():
    """fp64, mixed dtypes, an odd width, 3-D inputs: the op is eager torch's sequence."""
    _need_native()
    gen = torch.Generator().manual_seed(2)
    cases = ((torch.randn(1, 2, 3, 8, generator=gen, dtype=torch.float64), torch.randn(3, 8, generator=gen).double()),
             (torch.randn(1, 2, 3, 8, generator=gen).bfloat16(), torch.randn(3, 8, generator=gen)),
             (torch.randn(1, 2, 3, 7, generator=gen).bfloat16(), torch.randn(3, 7, generator=gen).bfloat16()),
             (torch.randn(2, 3, 8, generator=gen).bfloat16(), torch.randn(3, 8, generator=gen).bfloat16()))
    for x, c in cases:
        assert torch.equal(library.rotary_embedding(x, c, c.flip(-1)), rotary.rotary_reference(x, c, c.flip(-1)))


def test_opcheck():
    _need_native()
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(1, 4, 2, 16, generator=gen)
    c, s = torch.randn(1, 1, 2, 16, generator=gen), torch.randn(1, 1, 2, 16, generator=gen)
    for dtype in (torch.bfloat16, torch.float32, torch.float64):
        torch.library.opcheck(library.rotary_embedding.default, (x.to(dtype), c.to(dtype), s.to(dtype)))


def _count(engine, target):
    return sum(1 for n in engine.program.graph_module.graph.nodes if n.op == "call_function" and str(n.target) == target)


@pytest.mark.parametrize("dtype, fused", [(torch.float32, 4), (torch.bfloat16, 4), (torch.float64, 0)])
def test_pass_fuses_queries_and_keys(dtype, fused):
    _need_native()
    engine = dcpgraph.compile(tiny_model("qwen3", layers=2).to(dtype), backend="eager", max_num_seqs=1)
    assert _count(engine, OP) == fused  # queries and keys, per layer
    assert _count(engine, "aten.neg.default") == 4 - fused


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engine_logits_are_unchanged_by_the_pass(dtype, monkeypatch):
    """The same program with the pass and with the chains left to eager torch: equal logits,
    every step of a chunked prefill and decode."""
    _need_native()
    model = tiny_model("qwen3", layers=2).to(dtype)
    prompt = torch.randint(1, 200, (23,), generator=torch.Generator().manual_seed(3)).tolist()

    def run():
        engine = dcpgraph.compile(model, backend="eager", max_num_seqs=1, block_size=4, max_num_batched_tokens=8)
        logits = record_logits(engine)
        tokens = engine.generate([prompt], 6)
        return engine, tokens, logits

    fused, tokens, logits = run()
    monkeypatch.setattr(rotary, "native_enabled", lambda: False)
    plain, plain_tokens, plain_logits = run()
    assert _count(fused, OP) == 4 and _count(plain, OP) == 0
    assert tokens == plain_tokens and len(logits) == len(plain_logits) == 3 + 5
    for a, b in zip(logits, plain_logits):
        assert torch.equal(a, b)
