"""``dcpgraph.rotary_bf16`` and the ``native_rotary`` pass (:mod:`dcpgraph.ops.rotary`).

The native kernel is checked against eager torch's own op sequence (the op's meaning): equal bit
for bit, so a bf16 engine's logits are the same with and without the pass. Kernel tests skip,
naming why, where it cannot be built.
"""

from __future__ import annotations

import pytest
import torch

import dcpgraph
from dcpgraph.ops import library, rotary
from dcpgraph.testing.checkpoints import tiny_model
from dcpgraph.testing.generation import record_logits


def _need_native():
    if not rotary.native_enabled():
        pytest.skip(f"native bf16 rotary unavailable: {rotary.reason()}")


@pytest.mark.parametrize(
    "x_shape, cs_shape, transposed",
    [((1, 16, 1, 64), (1, 1, 1, 64), True),    # decode: one token, heads from a transposed view
     ((1, 4, 7, 128), (1, 1, 7, 128), True),   # a prefill chunk
     ((2, 3, 5, 32), (2, 1, 5, 32), False),    # a batch dim, contiguous
     ((1, 2, 3, 6), (3, 6), False)],           # cos/sin of fewer dims
)
def test_op_equals_eager_torch_bit_for_bit(x_shape, cs_shape, transposed):
    _need_native()
    gen = torch.Generator().manual_seed(sum(x_shape))
    b, h, t, d = x_shape
    x = (8 * torch.randn(b, t, h, d, generator=gen)).bfloat16().transpose(1, 2) if transposed else \
        (8 * torch.randn(x_shape, generator=gen)).bfloat16()
    cos, sin = (torch.randn(cs_shape, generator=gen).bfloat16() for _ in range(2))
    got = library.rotary_bf16(x, cos, sin)
    want = rotary.rotary_reference(x, cos, sin)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    assert torch.equal(got, want)


def test_other_inputs_take_eager_torch():
    """fp32, an odd width, 3-D inputs: the op is eager torch's sequence."""
    _need_native()
    gen = torch.Generator().manual_seed(2)
    for x, c in ((torch.randn(1, 2, 3, 8, generator=gen), torch.randn(3, 8, generator=gen)),
                 (torch.randn(1, 2, 3, 7, generator=gen).bfloat16(), torch.randn(3, 7, generator=gen).bfloat16()),
                 (torch.randn(2, 3, 8, generator=gen).bfloat16(), torch.randn(3, 8, generator=gen).bfloat16())):
        assert torch.equal(library.rotary_bf16(x, c, c.flip(-1)), rotary.rotary_reference(x, c, c.flip(-1)))


def test_opcheck():
    _need_native()
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(1, 4, 2, 16, generator=gen)
    c, s = torch.randn(1, 1, 2, 16, generator=gen), torch.randn(1, 1, 2, 16, generator=gen)
    for args in ((x.bfloat16(), c.bfloat16(), s.bfloat16()), (x, c, s)):
        torch.library.opcheck(library.rotary_bf16.default, args)


def _count(engine, target):
    return sum(1 for n in engine.program.graph_module.graph.nodes if n.op == "call_function" and str(n.target) == target)


def test_pass_fuses_queries_and_keys_of_bf16_programs_only():
    _need_native()
    model = tiny_model("qwen3", layers=2)
    fp32 = dcpgraph.compile(model, backend="eager", max_num_seqs=1)
    assert _count(fp32, "dcpgraph.rotary_bf16.default") == 0
    assert _count(fp32, "aten.neg.default") == 4
    bf16 = dcpgraph.compile(model.to(torch.bfloat16), backend="eager", max_num_seqs=1)
    assert _count(bf16, "dcpgraph.rotary_bf16.default") == 2 * 2  # queries and keys, per layer
    assert _count(bf16, "aten.neg.default") == 0


def test_bf16_engine_logits_are_unchanged_by_the_pass(monkeypatch):
    """The same bf16 program with the pass and with the chains left to eager torch: equal logits,
    every step of a chunked prefill and decode."""
    _need_native()
    model = tiny_model("qwen3", layers=2).to(torch.bfloat16)
    prompt = torch.randint(1, 200, (23,), generator=torch.Generator().manual_seed(3)).tolist()

    def run():
        engine = dcpgraph.compile(model, backend="eager", max_num_seqs=1, block_size=4, max_batched_tokens=8)
        logits = record_logits(engine)
        tokens = engine.generate([prompt], 6)
        return engine, tokens, logits

    fused, tokens, logits = run()
    monkeypatch.setattr(rotary, "native_enabled", lambda: False)
    plain, plain_tokens, plain_logits = run()
    assert _count(fused, "dcpgraph.rotary_bf16.default") == 4 and _count(plain, "dcpgraph.rotary_bf16.default") == 0
    assert tokens == plain_tokens and len(logits) == len(plain_logits) == 3 + 5
    for a, b in zip(logits, plain_logits):
        assert torch.equal(a, b)
