"""``lower_npu`` of ``mla_preprocess`` in this process, without torchair (the fused MLA preprocess).

The aten rule (everything the KV-RMSNorm-RoPE-cache op does not fit) runs here on CPU and must
reproduce the op's reference kernel: the absorbed query, the latent row and the cache with some
slots −1. The fused rule's checker accepts exactly the op's documented limits (512 + 64, bf16 or
fp16, interleaved rotary) and names the reason otherwise; the GE conversion itself is in
``test_torchair_mlapo``.
"""

from __future__ import annotations

import operator

import pytest
import torch

from dcpgraph.backends.npu import NpuLoweringError, lower_npu
from dcpgraph.backends.npu.rules import Site
from dcpgraph.backends.npu.rules_mlapo import kv_rmsnorm_rope_limits

pytestmark = pytest.mark.torchair
ops = torch.ops.dcpgraph


def _inputs(kind: str, q_lora: bool, *, rank=32, rope=8, dtype=torch.float64, tokens=5):
    gen = torch.Generator().manual_seed(7)
    d, heads, nope, q_rank = 40, 2, 16, 24

    def rnd(*shape, mean=0.0):
        return (mean + 0.3 * torch.randn(*shape, generator=gen, dtype=torch.float64)).to(dtype)

    angles = torch.rand(1, tokens, rope // 2, generator=gen) * 6
    if kind == "complex":
        rot, rot_sin = torch.polar(torch.ones_like(angles), angles), None
    else:
        rot, rot_sin = (torch.cat([f(angles), f(angles)], -1).to(dtype) for f in (torch.cos, torch.sin))
    return [
        rnd(1, tokens, d), *((rnd(q_rank, d), rnd(q_rank, mean=1.0)) if q_lora else (None, None)),
        rnd(heads * (nope + rope), q_rank if q_lora else d), rnd(rank + rope, d), rnd(rank, mean=1.0),
        rnd(heads, nope, rank), rot, rot_sin, rnd(3, 4, 1, rank + rope),
        torch.tensor([5, -1, 11, 0, -1][:tokens]), 1e-6, 2e-6, kind,
    ]


def _graph(args):
    """A GraphModule calling the op once on ``args`` (tensors as placeholders), with meta values."""
    graph = torch.fx.Graph()
    nodes = []
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            p = graph.placeholder(f"a{i}")
            p.meta["val"] = a
            nodes.append(p)
        else:
            nodes.append(a)
    node = graph.call_function(ops.mla_preprocess.default, tuple(nodes))
    node.meta["val"] = ops.mla_preprocess.default(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args])
    outs = [graph.call_function(operator.getitem, (node, i)) for i in range(3)]
    for i, o in enumerate(outs):
        o.meta["val"] = node.meta["val"][i]
    graph.output(tuple(outs))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


@pytest.mark.parametrize(("kind", "q_lora"), [("interleave", True), ("rotate_half", True), ("complex", False)])
def test_aten_rule_reproduces_the_reference_including_slot_minus_one(kind, q_lora):
    args = _inputs(kind, q_lora)
    lowered = lower_npu(_graph(args))
    assert lowered.meta["lower_npu"] == {"mla_preprocess->aten": 1}
    assert not [n for n in lowered.graph.nodes if getattr(n.target, "namespace", None) == "dcpgraph"]
    ref_args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    want = ops.mla_preprocess.default(*ref_args)
    low_args = [a.clone() for a in args if isinstance(a, torch.Tensor)]
    got = lowered(*low_args)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    assert torch.equal(low_args[-2], ref_args[9])  # the cache: rows of slots 5, 11, 0 written, the rest kept
    assert not torch.equal(ref_args[9], args[9])


def test_fused_rule_checker_names_what_does_not_fit():
    def site(kind, rank, rope, dtype):
        args = _inputs(kind, True, rank=rank, rope=rope, dtype=dtype)
        return Site(None, tuple(args))

    assert kv_rmsnorm_rope_limits(site("interleave", 512, 64, torch.bfloat16)) is None
    assert kv_rmsnorm_rope_limits(site("interleave", 512, 64, torch.float16)) is None
    assert kv_rmsnorm_rope_limits(site("interleave", 32, 8, torch.bfloat16)) == "latent 32 + rope 8 (the op takes 512 + 64)"
    assert kv_rmsnorm_rope_limits(site("interleave", 512, 64, torch.float32)) == (
        "dtype torch.float32 (the op takes float16 or bfloat16)")
    assert kv_rmsnorm_rope_limits(site("rotate_half", 512, 64, torch.bfloat16)) == (
        "rotate_half rotary (the op rotates DeepSeek's interleaved pairs)")


def test_fused_rule_without_torch_npu_is_a_clear_error():
    from dcpgraph.backends.npu.ascend import _has_op

    if _has_op("npu", "npu_kv_rmsnorm_rope_cache"):
        pytest.skip("torch_npu's npu_kv_rmsnorm_rope_cache is registered in this process (runs where it is not)")
    args = _inputs("interleave", True, rank=512, rope=64, dtype=torch.bfloat16, tokens=2)
    with pytest.raises(NpuLoweringError, match="npu_kv_rmsnorm_rope_cache is not registered"):
        lower_npu(_graph(args))
