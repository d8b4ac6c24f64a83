"""The native LSE merge (``csrc/merge_lse.h``) behind ``dcpgraph::merge_attention`` on CPU: it
passes its self-check here, serves the op, agrees with the reference (and with dense attention
through the op) on random partials and on every edge rule, and leaves what it does not take to the
reference."""

from __future__ import annotations

import pytest
import torch

import dcpgraph.ops.library  # noqa: F401  (registers torch.ops.dcpgraph)
from dcpgraph.ops import merge_native, native
from dcpgraph.ops.merge import merge_attention_reference, rescale_to_global_reference

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native extension unavailable: {native.reason}")


def test_the_native_merge_passes_its_self_check_and_serves_the_op(monkeypatch):
    assert merge_native.MERGE.enabled(), merge_native.MERGE.reason
    calls = []
    real = merge_native.merge_attention
    monkeypatch.setattr(merge_native, "merge_attention", lambda o, lse: calls.append(1) or real(o, lse))
    outs, lses = torch.randn(3, 2, 8, 64), torch.randn(3, 2, 8)
    out, lse = torch.ops.dcpgraph.merge_attention(outs, lses)
    assert calls and out.shape == (2, 8, 64) and lse.shape == (2, 8)


@pytest.mark.parametrize("n", [1, 2, 3, 9])
@pytest.mark.parametrize("dtype,lse_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                             (torch.float64, torch.float64), (torch.float16, torch.float64)])
def test_native_merge_agrees_with_the_reference(n, dtype, lse_dtype):
    gen = torch.Generator().manual_seed(n)
    outs = torch.randn(n, 5, 4, 40, generator=gen).to(dtype)
    lses = (torch.randn(n, 5, 4, generator=gen) * 30).to(lse_dtype)
    got = merge_native.merge_attention(outs, lses)
    ref = merge_attention_reference(outs, lses)
    assert got[0].dtype == ref[0].dtype and got[1].dtype == ref[1].dtype
    tol = {torch.float32: 1e-6, torch.float64: 1e-12, torch.bfloat16: 1e-2, torch.float16: 1e-3}[dtype]
    torch.testing.assert_close(got[0], ref[0], atol=tol, rtol=tol)
    torch.testing.assert_close(got[1], ref[1], atol=1e-6, rtol=1e-6)


def test_native_merge_keeps_every_edge_rule():
    """Empty shards (−inf), NaN and +inf LSEs count as empty; a NaN output of weight 0 adds
    nothing; a row of only empty shards is (0, −inf); a NaN output of weight > 0 stays NaN."""
    outs = torch.randn(3, 5, 16)
    lses = torch.randn(3, 5)
    lses[0, 0] = float("-inf")
    outs[0, 0, :] = float("nan")
    lses[1, 1] = float("nan")
    outs[1, 1, 3] = float("nan")
    lses[2, 2] = float("inf")
    lses[:, 3] = float("-inf")
    outs[2, 4, 7] = float("nan")  # weight > 0: NaN, as the reference gives
    out, lse = merge_native.merge_attention(outs, lses)
    ref_out, ref_lse = merge_attention_reference(outs, lses)
    assert torch.equal(out.isnan(), ref_out.isnan()) and bool(out[4, 7].isnan())
    assert not bool(out[:4].isnan().any())
    assert torch.equal(out[3], torch.zeros(16)) and lse[3] == float("-inf")
    torch.testing.assert_close(out[:4], ref_out[:4], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse, ref_lse, atol=1e-6, rtol=1e-6)


def test_what_the_native_merge_does_not_take_goes_to_the_reference():
    outs, lses = torch.randn(2, 3, 8), torch.randn(2, 3)
    assert merge_native.merge_attention(outs, lses[:, :2]) is None  # mismatched: the reference raises
    with pytest.raises(ValueError, match="trailing head-dim"):
        torch.ops.dcpgraph.merge_attention(outs, lses[:, :2])
    many = torch.randn(65, 2, 8), torch.randn(65, 2)  # more partials than the kernel's 64
    assert merge_native.merge_attention(*many) is None
    torch.testing.assert_close(torch.ops.dcpgraph.merge_attention(*many)[0], merge_attention_reference(*many)[0])
    assert merge_native.merge_attention(outs.to(torch.int32), lses) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_native_rescale_to_global_shares_the_merges_lse_and_sums_to_it(dtype):
    """Each rank's ``rescale_to_global`` gives the merge's global LSE bit for bit (one row routine
    for both), and the ranks' scaled partials sum to the merged output; empty shards scale to 0."""
    lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    gen = torch.Generator().manual_seed(3)
    outs = torch.randn(4, 3, 5, 24, generator=gen).to(dtype)
    lses = (torch.randn(4, 3, 5, generator=gen) * 10).to(lse_dtype)
    lses[2, 1, 1] = float("-inf")
    outs[2, 1, 1] = float("nan")
    lses[:, 0, 4] = float("-inf")
    out, lse = merge_native.merge_attention(outs, lses)
    total = 0
    for r in range(4):
        scaled, lse_g = merge_native.rescale_to_global(outs[r], lses[r], lses)
        ref_scaled, ref_g = rescale_to_global_reference(outs[r], lses[r], lses)
        assert torch.equal(lse_g, lse) and scaled.dtype == ref_scaled.dtype
        tol = 1e-12 if dtype == torch.float64 else 1e-6
        torch.testing.assert_close(scaled, ref_scaled, atol=tol, rtol=tol)
        torch.testing.assert_close(lse_g, ref_g, atol=tol, rtol=tol)
        total = total + scaled
    assert not bool(total.isnan().any()) and torch.equal(total[0, 4], torch.zeros_like(total[0, 4]))
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(total.to(dtype), out, atol=tol, rtol=tol)


def test_a_merge_never_starts_the_build(monkeypatch):
    """With the extension not loaded in this process the op runs the reference and loads nothing."""
    monkeypatch.setattr(merge_native.MERGE.extension, "module", None)
    monkeypatch.setattr(merge_native.MERGE.extension, "load", lambda: pytest.fail("a merge started the build"))
    outs, lses = torch.randn(3, 2, 8), torch.randn(3, 2)
    assert merge_native.merge_attention(outs, lses) is None
    assert merge_native.rescale_to_global(outs[0], lses[0], lses) is None
    out, lse = torch.ops.dcpgraph.merge_attention(outs, lses)
    ref = merge_attention_reference(outs, lses)
    assert torch.equal(out, ref[0]) and torch.equal(lse, ref[1])
