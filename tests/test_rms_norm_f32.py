"""``dcpgraph.rms_norm_f32`` and ``native_rms_norm`` on fp32 programs (:mod:`dcpgraph.ops.rms_norm_f32`).

The native kernel is checked against eager torch's own op sequence (the op's meaning): equal bit
for bit on contiguous rows; the compiled fp32 engine's greedy tokens against HF ``generate``.
Kernel tests skip, naming why, where it cannot be built.
"""

from __future__ import annotations

import pytest
import torch

import dcpgraph
from dcpgraph.ops import library, rms_norm_f32
from dcpgraph.testing.checkpoints import tiny_model
from dcpgraph.testing.generation import hf_greedy


def _need_native():
    if not rms_norm_f32.native_enabled():
        pytest.skip(f"native fp32 RMSNorm unavailable: {rms_norm_f32.reason()}")


def _hf_norm(x, w, eps):
    """HF's RMSNorm forward as written (LlamaRMSNorm / Qwen3RMSNorm), fp32."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


@pytest.mark.parametrize("shape", [(1, 1, 768), (1, 5, 16, 128), (3, 70), (2048, 768)])
def test_op_equals_hf_norm_bit_for_bit(shape):
    _need_native()
    gen = torch.Generator().manual_seed(sum(shape))
    x = 3 * torch.randn(shape, generator=gen)
    w = torch.randn(shape[-1], generator=gen)
    got = library.rms_norm_f32_op(x, w, 1e-6)
    assert got.dtype == torch.float32 and got.shape == x.shape
    assert torch.equal(got, _hf_norm(x, w, 1e-6))


def test_op_reads_a_strided_view_within_rounding():
    _need_native()
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 8, 64, generator=gen).transpose(0, 1)  # not contiguous
    w = torch.randn(64, generator=gen)
    torch.testing.assert_close(library.rms_norm_f32_op(x, w, 1e-5), _hf_norm(x, w, 1e-5), rtol=1e-6, atol=1e-6)


def _count(engine, target):
    return sum(1 for n in engine.program.graph_module.graph.nodes if n.op == "call_function" and str(n.target) == target)


def test_pass_fuses_every_fp32_norm_and_tokens_equal_hf():
    _need_native()
    model = tiny_model("qwen3", layers=2)
    engine = dcpgraph.compile(model, backend="eager", max_num_seqs=4)
    # input, post-attention, q and k norms per layer, and the final norm
    assert _count(engine, "dcpgraph.rms_norm_f32.default") == 4 * 2 + 1
    assert _count(engine, "aten.rsqrt.default") == 0 and _count(engine, "aten.pow.Tensor_Scalar") == 0
    prompts = [[5, 17, 99, 3], [42, 8, 120], [64, 7, 11, 2, 9]]
    assert engine.generate(prompts, 8) == [hf_greedy(model, p, 8) for p in prompts]
