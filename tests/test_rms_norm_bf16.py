"""``dcpgraph.rms_norm_bf16`` and the ``native_rms_norm`` pass (:mod:`dcpgraph.ops.rms_norm`).

The native kernel is checked against eager torch's own op sequence (the op's meaning): equal bit
for bit. Kernel tests skip, naming why, where it cannot be built.
"""

from __future__ import annotations

import pytest
import torch

import dcpgraph
from dcpgraph.ops import library, rms_norm
from dcpgraph.testing.checkpoints import tiny_model


def _need_native():
    if not rms_norm.native_enabled():
        pytest.skip(f"native bf16 RMSNorm unavailable: {rms_norm.reason()}")


@pytest.mark.parametrize("shape", [(1, 1, 1024), (1, 5, 16, 128), (3, 70), (2, 1, 31)])
def test_op_equals_eager_torch_bit_for_bit(shape):
    _need_native()
    gen = torch.Generator().manual_seed(sum(shape))
    x = (3 * torch.randn(shape, generator=gen)).bfloat16()
    w = torch.randn(shape[-1], generator=gen).bfloat16()
    got = library.rms_norm_bf16(x, w, 1e-6)
    want = rms_norm.rms_norm_reference(x, w, 1e-6)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    assert torch.equal(got, want)


def test_op_reads_a_strided_view_and_falls_back_for_fp32():
    _need_native()
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(4, 8, 64, generator=gen).bfloat16()
    x = base.transpose(0, 1)  # not contiguous
    w = torch.randn(64, generator=gen).bfloat16()
    assert torch.equal(library.rms_norm_bf16(x, w, 1e-5), rms_norm.rms_norm_reference(x.contiguous(), w, 1e-5))
    xf, wf = x.float(), w.float()
    assert torch.equal(library.rms_norm_bf16(xf, wf, 1e-5), rms_norm.rms_norm_reference(xf, wf, 1e-5))


def _count(engine, target):
    return sum(1 for n in engine.program.graph_module.graph.nodes if n.op == "call_function" and str(n.target) == target)


def test_pass_fuses_every_bf16_norm_to_the_bf16_op_only():
    _need_native()
    model = tiny_model("qwen3", layers=2)
    fp32 = dcpgraph.compile(model, backend="eager", max_num_seqs=1)  # fp32 norms: rms_norm_f32's
    assert _count(fp32, "dcpgraph.rms_norm_bf16.default") == 0
    fp64 = dcpgraph.compile(tiny_model("qwen3", layers=2, dtype=torch.float64), backend="eager", max_num_seqs=1)
    assert _count(fp64, "aten.rsqrt.default") == 9
    bf16 = dcpgraph.compile(model.to(torch.bfloat16), backend="eager", max_num_seqs=1)
    # input, post-attention, q and k norms per layer, and the final norm
    assert _count(bf16, "dcpgraph.rms_norm_bf16.default") == 4 * 2 + 1
    assert _count(bf16, "aten.rsqrt.default") == 0 and _count(bf16, "aten.pow.Tensor_Scalar") == 0


class _Norm(torch.nn.Module):
    def __init__(self, escape: bool):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(8).bfloat16())
        self.escape = escape

    def forward(self, x):
        h = x.to(torch.float32)
        r = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        y = self.weight * (h * r).to(torch.bfloat16)
        return (y, r) if self.escape else y


@pytest.mark.parametrize("escape", [False, True])
def test_a_chain_whose_intermediate_is_read_elsewhere_is_not_fused(escape):
    from dcpgraph.passes.native_rms_norm import match_rms_norm

    exported = torch.export.export(_Norm(escape), (torch.randn(2, 8).bfloat16(),))
    params = set(exported.graph_signature.inputs_to_parameters)
    for node in list(exported.graph.nodes):  # dcpgraph's front end drops these checks too
        if node.target is torch.ops.aten._assert_tensor_metadata.default:
            exported.graph.erase_node(node)
    matches = [m for n in exported.graph.nodes if (m := match_rms_norm(n, params))]
    assert len(matches) == (0 if escape else 1)


def test_opcheck_with_and_without_the_native_kernel():
    rms_norm.native_enabled()  # registers the C++ kernel where it builds
    gen = torch.Generator().manual_seed(5)
    x, w = torch.randn(1, 3, 64, generator=gen), torch.randn(64, generator=gen)
    for args in ((x.bfloat16(), w.bfloat16(), 1e-6), (x, w, 1e-5)):
        torch.library.opcheck(library.rms_norm_bf16.default, args)
