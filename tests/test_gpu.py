"""The gpu tier: the same ops, passes and executors on a CUDA device.

Every test here is marked ``gpu`` and skips, with the reason, where torch sees no CUDA device
(``tests/conftest.py``). References are independent of the code under test: the ops' CPU results
on the same inputs, and HF ``generate`` of the same weights on the same device.
"""

from __future__ import annotations

import pytest
import torch

import dcpgraph
from dcpgraph.models import build_model
from dcpgraph.ops import quant
from dcpgraph.testing.generation import hf_greedy

pytestmark = pytest.mark.gpu
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9], [11, 12, 13]]


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_paged_attention_on_cuda_equals_cpu(kv_dtype):
    import dcpgraph.ops.library  # noqa: F401

    gen = torch.Generator().manual_seed(0)
    nb, block, hkv, hq, d = 16, 4, 2, 8, 64
    k, v = torch.randn(nb, block, hkv, d, generator=gen), torch.randn(nb, block, hkv, d, generator=gen)
    ks = vs = None
    if quant.is_fp8(kv_dtype):
        k, ks = (t.view(nb, block, hkv, -1) for t in quant.quantize_fp8(k.view(-1, hkv, d)))
        v, vs = (t.view(nb, block, hkv, -1) for t in quant.quantize_fp8(v.view(-1, hkv, d)))
    else:
        k, v = k.to(kv_dtype), v.to(kv_dtype)
    q = torch.randn(3, hq, d, generator=gen)
    table = torch.randperm(nb, generator=gen)[:12].view(3, 4).to(torch.int32)
    cu, lens = torch.arange(4, dtype=torch.int32), torch.tensor([0, 7, 16], dtype=torch.int32)
    args = (q, k, v, table, cu, lens, None, 0.125)
    cpu = torch.ops.dcpgraph.paged_attention(*args, k_scales=ks, v_scales=vs)
    on = [None if a is None else (a.cuda() if isinstance(a, torch.Tensor) else a) for a in args]
    cuda = torch.ops.dcpgraph.paged_attention(*on, k_scales=None if ks is None else ks.cuda(),
                                              v_scales=None if vs is None else vs.cuda())
    assert cuda[0].device.type == "cuda"
    torch.testing.assert_close(cuda[0].cpu(), cpu[0], atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(cuda[1].cpu(), cpu[1], atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("tp,dcp", [(1, 1), (2, 2)])
def test_engine_on_cuda_equals_hf_generate(tp, dcp):
    model = build_model("qwen3", dtype=torch.float64).cuda()
    engine = dcpgraph.compile(model, tp=tp, dcp=dcp, block_size=4, backend="eager")
    assert {c.device.type for c in engine.executor.rank_caches(0).values()} == {"cuda"}
    assert engine.generate(PROMPTS, 8) == [hf_greedy(model, p, 8) for p in PROMPTS]


def test_inductor_on_cuda_captures_at_start_up_and_equals_hf():
    model = build_model("qwen3", dtype=torch.float32).cuda()
    engine = dcpgraph.compile(model, block_size=4, backend="inductor", capture_limit=4)
    assert engine.generate(PROMPTS, 8) == [hf_greedy(model, p, 8) for p in PROMPTS]
    report = engine.report()
    assert report["compile"]["compiles_after_startup"] == 0
    assert all(s["fallback"] is None for s in report["graphs"].values())
    assert report["device_graphs"] == "cuda"  # the default cudagraph_mode: decode buckets captured
    captured = {name: s["device_graph"] for name, s in report["graphs"].items() if name != "mixed"}
    assert captured and all(s["captured"] and s["reason"] is None for s in captured.values()), captured


ARRIVALS = {0: [PROMPTS[0]], 1: PROMPTS[1:3], 3: [[5] * 9], 6: [[7, 8]]}  # decode batches of 1 to 4


@pytest.mark.parametrize("backend", ["aot_eager"])  # inductor: the test above (against HF)
def test_cuda_graph_decode_equals_eager_and_replays_once_per_decode_step(backend):
    """Decode buckets captured as CUDA graphs (``cudagraph_mode`` FULL_DECODE_ONLY) give eager's
    tokens step for step while requests arrive and leave, and every decode step on a bucket is one
    replay of its graph (the model runner's step counts against the wrapper's replay counts)."""
    from dcpgraph.testing.device_graphs import replays_and_decode_steps, serve_arrivals

    model = build_model("qwen3", dtype=torch.float32).cuda()
    options = dict(block_size=4, capture_limit=4, max_num_seqs=8)
    captured = dcpgraph.compile(model, backend=backend, **options)
    uncaptured = dcpgraph.compile(model, backend=backend, cudagraph_mode="NONE", **options)
    eager = dcpgraph.compile(model, backend="eager", **options)
    expected = serve_arrivals(eager, ARRIVALS, 6)
    assert serve_arrivals(captured, ARRIVALS, 6) == expected
    assert serve_arrivals(uncaptured, ARRIVALS, 6) == expected
    report = captured.report()
    replays, decode_steps = replays_and_decode_steps(report)
    assert len(decode_steps) == 3 and replays == decode_steps, (replays, decode_steps)
    assert all(s["device_graph"]["uncaptured_calls"] == 0 for n, s in report["graphs"].items() if n != "mixed")
    assert "device_graphs" not in uncaptured.report()


def _nccl_rank(rank, world):
    import torch.distributed as dist

    model = build_model("qwen3", dtype=torch.float64).cuda()
    engine = dcpgraph.compile(model, tp=world, dcp=world, block_size=4, backend="eager")
    assert dist.get_backend() == "nccl" and engine.executor.mode == "distributed"
    return engine.generate(PROMPTS, 6)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL tp=2 dcp=2 needs two CUDA devices")
def test_nccl_tp2_dcp2_equals_hf():
    from dcpgraph.runtime.distributed import backend_for, spawn

    results = spawn(_nccl_rank, 2, backend=backend_for("cuda"), timeout_s=600)
    model = build_model("qwen3", dtype=torch.float64).cuda()
    assert results[0] == results[1] == [hf_greedy(model, p, 6) for p in PROMPTS]


def _checkpoint_and_reference(tmp_path):
    from dcpgraph.testing.checkpoints import save_tiny_checkpoint

    path = save_tiny_checkpoint(tmp_path / "qwen3", "qwen3")
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    return path, [hf_greedy(model, p, 6) for p in PROMPTS]


def test_llm_loads_a_checkpoint_onto_cuda_and_equals_hf(tmp_path):
    """``LLM(device="cuda")`` at tp=1: the checkpoint's slices are read and moved to the GPU, the
    KV cache is sized from 0.9 of the device's memory, and the tokens are HF's on the same GPU."""
    from dcpgraph import LLM, SamplingParams

    path, expected = _checkpoint_and_reference(tmp_path)
    llm = LLM(path, device="cuda", dtype="float32", max_model_len=64)
    caches = llm.engine.executor.rank_caches(0).values()
    assert {c.device.type for c in caches} == {"cuda"}
    assert llm.engine.memory_report()["kv_sizing"]["device"].startswith("cuda")
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0, max_tokens=6))
    assert [list(o.outputs[0].token_ids) for o in outs] == expected


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="worker processes on two GPUs need two CUDA devices")
def test_llm_workers_on_two_gpus_use_nccl_and_equal_hf(tmp_path):
    """``LLM(device="cuda", tensor_parallel_size=2, decode_context_parallel_size=2)``: two worker
    processes on cuda:0 and cuda:1, an NCCL world, HF's tokens."""
    from dcpgraph import LLM, SamplingParams

    path, expected = _checkpoint_and_reference(tmp_path)
    llm = LLM(path, device="cuda", tensor_parallel_size=2, decode_context_parallel_size=2, dtype="float32",
              max_model_len=64)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0, max_tokens=6))
        assert [list(o.outputs[0].token_ids) for o in outs] == expected
        assert llm.engine.memory_report()["kv_sizing"]["device"].startswith("cuda")
    finally:
        llm.engine.close()
