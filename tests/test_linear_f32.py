"""``dcpgraph.linear_f32`` and the ``native_linear`` pass on fp32 programs (:mod:`dcpgraph.ops.linear_f32`).

The native kernel is checked against an fp64 reference, with torch's own fp32 linear as the
yardstick for the summation-order error fp32 allows. Without an AVX2 + FMA CPU (or with
``DCPGRAPH_NATIVE=0``) the kernel tests skip, naming why; the fallback tests still run.
"""

from __future__ import annotations

import pytest
import torch

import dcpgraph
from dcpgraph.ops import library, linear_f32
from dcpgraph.testing.checkpoints import tiny_model
from dcpgraph.testing.generation import hf_greedy, teacher_forced_logits


def _need_native():
    if not linear_f32.native_enabled():
        pytest.skip(f"native fp32 linear unavailable: {linear_f32.reason()} (runs on an AVX2 + FMA CPU)")


def _assert_fp32_close(got, x, w, b):
    ref = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    bound = x.double().abs() @ w.double().abs().T  # scale of the fp32 summation error
    err = (got.double() - ref).abs()
    assert bool((err <= 1e-5 * bound + 1e-30).all()), f"max error {float(err.max())}"
    torch_err = (torch.nn.functional.linear(x, w, b).double() - ref).abs()
    assert bool((torch_err <= 1e-5 * bound + 1e-30).all())  # the yardstick holds for torch too


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 17])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("k", [7, 64, 211])  # shorter than a vector, a multiple of 16, ragged
def test_op_matches_an_fp64_reference(rows, with_bias, k):
    gen = torch.Generator().manual_seed(rows * 1000 + k)
    n = 45  # not a multiple of any register block (8, 6, 4, 3 W rows)
    x, w = torch.randn(1, rows, k, generator=gen), torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if with_bias else None
    got = library.linear_f32_op(x, w, b)
    assert got.dtype == torch.float32 and got.shape == (1, rows, n)
    _assert_fp32_close(got.reshape(rows, n), x.reshape(rows, k), w, b)


def _calls():
    return dict(zip(("native", "torch"), linear_f32.EXTENSION.module.kernel_calls()))


def test_native_kernel_runs_for_decode_rows_and_torch_beyond():
    """The op's C++ CPU kernel applies native_applies's rule: its call counts move as it says."""
    _need_native()
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(70, 99, generator=gen)
    for rows in (1, linear_f32.MAX_ROWS, linear_f32.MAX_ROWS + 1):
        x = torch.randn(1, rows, 99, generator=gen)
        before = _calls()
        got = library.linear_f32_op(x, w)
        after = _calls()
        expected = "native" if rows <= linear_f32.MAX_ROWS else "torch"
        assert linear_f32.native_applies(x, w) == (expected == "native")
        assert {k: after[k] - before[k] for k in after} == {k: int(k == expected) for k in after}, rows
        _assert_fp32_close(got.reshape(rows, 70), x.reshape(rows, 99), w, None)


def test_native_kernel_reads_strided_rows():
    """Each rank's shard of a row-parallel weight is a column slice (rows further apart than K)."""
    _need_native()
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(4, 300, generator=gen)[:, 10:110]
    w = torch.randn(33, 256, generator=gen)[:, :100]
    _assert_fp32_close(library.linear_f32_op(x, w), x, w, None)


def test_checker_declines_what_the_kernel_does_not_run():
    x, w = torch.randn(2, 64), torch.randn(8, 64)
    assert not linear_f32.native_applies(x.double(), w.double())
    assert not linear_f32.native_applies(x.bfloat16(), w.bfloat16())
    assert not linear_f32.native_applies(x, w.t().contiguous().t())  # columns not dense
    assert not linear_f32.native_applies(x, w, torch.randn(8).double())
    assert torch.equal(library.linear_f32_op(x.double(), w.double()), torch.nn.functional.linear(x.double(), w.double()))


def test_pass_rewrites_fp32_linears_and_tokens_equal_hf():
    """Every linear of an fp32 program (7 per layer and the LM head) becomes the op, and greedy
    decoding of a batch of prompts (decode steps of several rows) gives HF's tokens."""
    _need_native()
    model = tiny_model("qwen3", layers=2)
    engine = dcpgraph.compile(model, backend="eager", max_num_seqs=4)
    targets = [str(n.target) for n in engine.program.graph_module.graph.nodes if n.op == "call_function"]
    assert "aten.linear.default" not in targets
    assert targets.count("dcpgraph.linear_f32.default") == 7 * 2 + 1
    prompts = [[5, 17, 99, 3], [42, 8, 120], [64, 7, 11, 2, 9], [1, 30]]
    before = _calls()
    got = engine.generate(prompts, 8)
    assert _calls()["native"] > before["native"]
    assert got == [hf_greedy(model, p, 8) for p in prompts]


def test_teacher_forced_logits_equal_torch_linears_to_fp32_noise(monkeypatch):
    _need_native()
    tokens = [5, 17, 99, 3, 42, 8, 120, 64]
    model = tiny_model("qwen3", layers=2)
    native = teacher_forced_logits(dcpgraph.compile(model, backend="eager", max_num_batched_tokens=1), tokens)
    monkeypatch.setenv("DCPGRAPH_NATIVE", "0")
    monkeypatch.setattr(linear_f32, "_state", {})
    torch_engine = dcpgraph.compile(model, backend="eager", max_num_batched_tokens=1)
    assert "DCPGRAPH_NATIVE=0" in [p.summary for p in torch_engine.program.provenance if p.name == "native_linear"][0]
    plain = teacher_forced_logits(torch_engine, tokens)
    assert float((native - plain).abs().max()) <= 1e-4 * float(plain.abs().max())


def test_opcheck_with_and_without_the_native_kernel():
    linear_f32.native_enabled()  # registers the C++ kernel where it builds
    gen = torch.Generator().manual_seed(5)
    x, w, b = torch.randn(1, 3, 64, generator=gen), torch.randn(40, 64, generator=gen), torch.randn(40, generator=gen)
    for args in ((x, w), (x, w, b), (x.double(), w.double())):
        torch.library.opcheck(library.linear_f32_op.default, args)
