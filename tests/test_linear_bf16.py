"""``dcpgraph.linear_bf16`` and the ``native_linear`` pass (:mod:`dcpgraph.ops.linear`).

The native kernel is checked against an fp32 reference (``x.float() @ W.float().T + b``), with
torch's own bf16 linear as the yardstick for the error bf16 allows: both round an fp32 sum once,
so each output is within half a bf16 ulp of the reference, plus fp32 summation-order error.
Without an AVX512-BF16 or AVX2 + FMA CPU (or with ``DCPGRAPH_NATIVE=0``) the kernel tests skip,
naming why; the fallback and pass-skipping tests still run.
"""

from __future__ import annotations

import pytest
import torch

import dcpgraph
from dcpgraph.ops import library, linear
from dcpgraph.testing.checkpoints import tiny_model
from dcpgraph.testing.generation import teacher_forced_logits


def _need_native():
    if not linear.native_enabled():
        pytest.skip(f"native bf16 linear unavailable: {linear.reason()} (runs on an AVX512-BF16 or AVX2 + FMA CPU)")


def _reference(x, w, b):
    ref = x.float() @ w.float().T
    bound = x.float().abs() @ w.float().abs().T  # scale of the fp32 summation error
    return (ref if b is None else ref + b.float()), bound


def _assert_bf16_close(got, ref, bound):
    half_ulp = ref.abs() * 2.0**-8  # bf16 keeps 8 significant bits: round-to-nearest errs ≤ 2^-9 relative
    err = (got.float() - ref).abs()
    assert bool((err <= half_ulp + 1e-5 * bound + 1e-30).all()), f"max error {float(err.max())}"


@pytest.mark.parametrize("rows", [1, 3, 16, 17, 40])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("k", [211, 212])  # neither a multiple of 32; odd K is not for AMX
def test_op_matches_an_fp32_reference_within_bf16_rounding(rows, with_bias, k):
    gen = torch.Generator().manual_seed(rows)
    n = 45  # not a multiple of 16 (AMX's rows) nor of any register block
    x = torch.randn(rows, k, generator=gen).bfloat16()
    w = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if with_bias else None
    ref, bound = _reference(x, w, b)
    got = library.linear_bf16(x, w, b)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    _assert_bf16_close(got, ref, bound)
    _assert_bf16_close(torch.nn.functional.linear(x, w, b), ref, bound)  # the yardstick holds for torch too


def _kernels():
    _need_native()
    mod = linear.EXTENSION.module
    kernels = {"dot": mod.linear_bf16}
    if linear._state.get("amx"):
        kernels["amx"] = mod.linear_bf16_amx
    return kernels


@pytest.mark.parametrize("kernel", ["dot", "amx"])
@pytest.mark.parametrize("rows", [1, 2, 7, 16])
@pytest.mark.parametrize("shape", [(100, 45), (1024, 70), (66, 16), (64, 5)])  # (K, N); N = 5: fewer W rows than a block
def test_each_kernel_matches_an_fp32_reference(kernel, rows, shape):
    run = _kernels().get(kernel)
    if run is None:
        pytest.skip(f"no AMX here: {linear._state.get('amx_reason') or 'CPU/OS without AMX-BF16'}")
    k, n = shape
    gen = torch.Generator().manual_seed(rows * k + n)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    w = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen)
    ref, bound = _reference(x, w, b)
    got = torch.full((rows, n), float("nan"), dtype=torch.bfloat16)
    assert run(x, w, b, got, 256)
    _assert_bf16_close(got, ref, bound)


def _calls():
    return dict(zip(("amx", "dot", "torch", "fp32"), linear.EXTENSION.module.kernel_calls()))


def test_native_kernel_runs_for_decode_rows_and_torch_beyond():
    """The op's C++ CPU kernel applies native_kernel's rule: its per-kernel call counts move as
    the rule says, and each result is right."""
    kernels = _kernels()
    gen = torch.Generator().manual_seed(1)
    dot_rows = linear.dot_max_rows()
    for k in (98, 99):  # even K: AMX where present; odd K: the dot kernel up to dot_max_rows()
        w = torch.randn(70, k, generator=gen).bfloat16()
        for rows in sorted({1, dot_rows, dot_rows + 1, linear.MAX_ROWS, linear.MAX_ROWS + 1}):
            x = torch.randn(1, rows, k, generator=gen).bfloat16()  # the graph's [1, T, K]
            expected = linear.native_kernel(x, w) or "torch"
            before = _calls()
            got = library.linear_bf16(x, w)
            after = _calls()
            assert {name: after[name] - before[name] for name in after} == {
                name: int(name == expected) for name in after}, (k, rows)
            ref, bound = _reference(x, w, None)
            _assert_bf16_close(got, ref, bound)
            amx = "amx" in kernels and k % 2 == 0
            want = ("amx" if amx else "dot" if rows <= dot_rows else "torch") \
                if rows <= linear.MAX_ROWS else "fp32" if linear.fp32_beyond() else "torch"
            assert expected == want, (k, rows)


def test_fp32_kernel_matches_the_reference_over_several_slabs():
    """The many-row kernel of AVX2 builds widens W a slab of rows at a time (8 MiB of fp32): a
    weight of three slabs and a ragged last one, with a bias, rounds the fp32 result once."""
    _need_native()
    gen = torch.Generator().manual_seed(3)
    k = 4096  # 512 rows a slab
    x = torch.randn(2, 10, k, generator=gen).bfloat16()
    w = torch.randn(1100, k, generator=gen).bfloat16()
    b = torch.randn(1100, generator=gen).bfloat16()
    got = linear.EXTENSION.module.linear_fp32(x, w, b)
    assert got.dtype == torch.bfloat16 and got.shape == (2, 10, 1100)
    ref, bound = _reference(x.reshape(-1, k), w, b)
    _assert_bf16_close(got.reshape(-1, 1100), ref, bound)


def test_native_kernel_reads_strided_rows():
    _need_native()
    gen = torch.Generator().manual_seed(2)
    base = torch.randn(4, 300, generator=gen).bfloat16()
    x = base[:, 10:110]  # rows 300 apart
    w_base = torch.randn(33, 256, generator=gen).bfloat16()
    w = w_base[:, :100]  # a column slice of a weight: rows 256 apart
    ref, bound = _reference(x, w, None)
    _assert_bf16_close(library.linear_bf16(x, w), ref, bound)


def test_checker_declines_what_the_kernel_does_not_run():
    x = torch.randn(2, 64).bfloat16()
    w = torch.randn(8, 64).bfloat16()
    assert not linear.native_applies(x.float(), w.float())
    assert not linear.native_applies(x, w.float())
    # more rows than the kernels take: torch's bf16 linear, or the fp32 GEMM on AVX2 builds
    many = torch.randn(linear.MAX_ROWS + 1, 64).bfloat16()
    assert linear.native_kernel(many, w) == ("fp32" if linear.fp32_beyond() else None)
    assert not linear.native_applies(x, w.t().contiguous().t())  # columns not dense
    assert not linear.native_applies(x, w, torch.randn(8))  # an fp32 bias: torch would refuse it
    # fp32 through the op is torch's linear exactly
    xf, wf = x.float(), w.float()
    assert torch.equal(library.linear_bf16(xf, wf), torch.nn.functional.linear(xf, wf))


def test_fake_kernel_gives_the_output_shape():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        y = library.linear_bf16(torch.empty(1, 3, 40, dtype=torch.bfloat16), torch.empty(7, 40, dtype=torch.bfloat16))
    assert y.shape == (1, 3, 7) and y.dtype == torch.bfloat16


def _summary(engine, stage: str) -> str:
    (record,) = [p for p in engine.program.provenance if p.name == stage]
    return record.summary


def _targets(engine):
    return [str(n.target) for n in engine.program.graph_module.graph.nodes if n.op == "call_function"]


def test_pass_rewrites_bf16_linears_to_the_bf16_op_only():
    _need_native()
    model = tiny_model("qwen3", layers=2)
    fp32 = dcpgraph.compile(model, backend="eager", max_num_seqs=2)
    assert "dcpgraph.linear_bf16.default" not in _targets(fp32)
    fp64 = dcpgraph.compile(tiny_model("qwen3", layers=1).double(), backend="eager", max_num_seqs=2)
    assert _summary(fp64, "native_linear") == "no linear by a bf16 or fp32 CPU parameter"
    bf16 = dcpgraph.compile(model.to(torch.bfloat16), backend="eager", max_num_seqs=2)
    targets = _targets(bf16)
    assert "aten.linear.default" not in targets
    assert targets.count("dcpgraph.linear_bf16.default") == 7 * 2 + 1  # q,k,v,o,gate,up,down per layer + LM head


def test_pass_keeps_torch_linears_when_the_kernel_is_off(monkeypatch):
    monkeypatch.setenv("DCPGRAPH_NATIVE", "0")
    engine = dcpgraph.compile(tiny_model("qwen3", layers=1).to(torch.bfloat16), backend="eager", max_num_seqs=1)
    assert "dcpgraph.linear_bf16.default" not in _targets(engine)
    assert "DCPGRAPH_NATIVE=0" in _summary(engine, "native_linear")


def test_bf16_engine_logits_stay_as_close_to_fp32_as_torch_bf16(monkeypatch):
    """Teacher-forced decode logits (every step one row, so every linear runs natively) of the
    bf16 engine against the fp32 model's: no further from them than the same engine on torch's
    bf16 linear is."""
    _need_native()
    tokens = [5, 17, 99, 3, 42, 8, 120, 64, 7, 11]
    model = tiny_model("qwen3", layers=2)
    ref = teacher_forced_logits(dcpgraph.compile(model, backend="eager", max_num_batched_tokens=1), tokens)
    model = model.to(torch.bfloat16)
    native = dcpgraph.compile(model, backend="eager", max_num_batched_tokens=1)
    assert "dcpgraph.linear_bf16.default" in _targets(native)
    got = teacher_forced_logits(native, tokens).float()
    monkeypatch.setenv("DCPGRAPH_NATIVE", "0")
    torch_bf16 = teacher_forced_logits(dcpgraph.compile(model, backend="eager", max_num_batched_tokens=1), tokens).float()
    native_err = float((got - ref).abs().max())
    torch_err = float((torch_bf16 - ref).abs().max())
    assert native_err <= 1.5 * torch_err + 1e-3, (native_err, torch_err)
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


@pytest.mark.slow
def test_inductor_compiles_programs_with_the_op_and_matches_eager():
    """The op's fake kernel lets inductor compile the bf16 program (no eager fallback), and the
    compiled graph calls the same kernel: teacher-forced logits equal eager's within bf16 noise."""
    _need_native()
    tokens = [5, 17, 99, 3, 42, 8]
    model = tiny_model("qwen3", layers=1).to(torch.bfloat16)
    eager = teacher_forced_logits(dcpgraph.compile(model, backend="eager", max_num_batched_tokens=1), tokens).float()
    engine = dcpgraph.compile(model, backend="inductor", max_num_batched_tokens=1, max_num_seqs=1)
    assert "dcpgraph.linear_bf16.default" in _targets(engine)
    compiled = teacher_forced_logits(engine, tokens).float()
    graphs = engine.report()["graphs"]
    assert graphs and all(g["backend"] == "inductor" and g["fallback"] is None for g in graphs.values()), graphs
    assert float((compiled - eager).abs().max()) <= 0.05 * float(eager.abs().max())


def test_a_missing_kernel_source_leaves_torch_linears_and_says_why(monkeypatch, tmp_path):
    from dcpgraph.ops.native_build import NativeExtension

    missing = tmp_path / "csrc" / "linear_bf16.cpp"
    fresh = NativeExtension(linear.EXTENSION.name, missing, linear.EXTENSION.what, linear.EXTENSION.fallback)
    monkeypatch.setattr(linear, "EXTENSION", fresh)
    monkeypatch.setattr(linear, "_state", {})
    monkeypatch.delenv("DCPGRAPH_NATIVE", raising=False)
    with pytest.warns(RuntimeWarning, match="is missing from this installation"):
        assert not linear.native_enabled()
    assert str(missing) in linear.reason() and "torch's kernel" in linear.reason()
    x, w = torch.randn(2, 64).bfloat16(), torch.randn(8, 64).bfloat16()
    assert linear.native_kernel(x, w) is None
    assert torch.equal(linear.linear_bf16(x, w), torch.nn.functional.linear(x, w))


def test_opcheck_with_and_without_the_native_kernel():
    """Schema, fake kernel and AOT dispatch hold for the op, whichever CPU kernel serves it."""
    linear.native_enabled()  # registers the C++ kernel where it builds
    gen = torch.Generator().manual_seed(5)
    x, w, b = torch.randn(1, 3, 64, generator=gen), torch.randn(40, 64, generator=gen), torch.randn(40, generator=gen)
    for args in ((x.bfloat16(), w.bfloat16()), (x.bfloat16(), w.bfloat16(), b.bfloat16()), (x, w, b)):
        torch.library.opcheck(library.linear_bf16.default, args)
