"""dtypes end to end: bf16 models, and ``kv_cache_dtype`` = auto | bf16 | fp8_e4m3.

References, all independent of the code under test:

* bf16: HF's own forward of the same bf16 weights, and the fp32 forward as the truth. "Within bf16
  tolerance" means dcpgraph's teacher-forced bf16 logits are no further from the fp32 logits than
  twice HF's bf16 logits are (max and mean absolute error), at tp=1 and at tp=2/dcp=2.
* greedy tokens at tp=2/dcp=2 equal the dcp=1 run's where the margin is safe: the two token
  streams must agree up to their first difference, and that difference may only come at a
  position where the dcp=1 run's top-1 − top-2 logit gap was below ``SAFE_MARGIN`` (0.25, above
  the largest bf16 logit difference between meshes measured here, ~0.1); after it the runs
  legitimately diverge (different contexts), so comparison stops. At least 4 equal positions
  must have had a safe margin, so the check is not vacuous.
* fp8: the op against a by-hand dequantisation of the cache (quantisation error bound of e4m3:
  ≤ 2⁻⁴ relative per element of its scale group's max), paged attention over fp8 caches against
  the same op over the dequantised floating-point caches, byte counts against the planner.
"""

from __future__ import annotations

import pytest
import torch

import dcpgraph
from dcpgraph import ConfigError
from dcpgraph.capacity import bytes_per_block, cache_shapes
from dcpgraph.models import build_model, tiny_config
from dcpgraph.ops import quant
from dcpgraph.plan.model_shape import from_config
from dcpgraph.runtime.engine import kv_bytes_per_block
from dcpgraph.testing.generation import record_logits, teacher_forced_logits

ops = torch.ops.dcpgraph
SAFE_MARGIN = 0.25


def redraw(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Weights at a scale where attention matters (HF's 0.02 init gives near-flat logits)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.3 * noise if "norm" in name else 0.2 * noise)
    return model


@pytest.fixture(scope="module")
def qwen3_pair():
    """(fp32, bf16) Qwen3 (q/k norm, 1 KV head, head_dim 16) with the same weights."""
    fp32 = redraw(build_model("qwen3", dtype=torch.float32), 3)
    bf16 = build_model("qwen3", dtype=torch.bfloat16)
    bf16.load_state_dict(fp32.state_dict())
    return fp32, bf16


# -- bf16 models -------------------------------------------------------------------------------
@pytest.mark.parametrize("tp,dcp", [(1, 1), (2, 2)])
def test_bf16_logits_within_bf16_tolerance_of_hf(qwen3_pair, tp, dcp):
    fp32, bf16 = qwen3_pair
    tokens = torch.randint(1, 256, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        truth = fp32(tokens).logits[0]
        hf = bf16(tokens).logits[0].float()
    engine = dcpgraph.compile(bf16, tp=tp, dcp=dcp, block_size=4, max_num_batched_tokens=1)
    assert {c.dtype for c in engine.program.caches} == {torch.bfloat16}
    got = teacher_forced_logits(engine, tokens[0].tolist())
    assert got.dtype == torch.bfloat16
    got = got.float()
    hf_err, err = (hf - truth).abs(), (got - truth).abs()
    assert hf_err.max() > 0  # the bf16 reference really is bf16
    assert err.max() <= 2 * hf_err.max(), (err.max(), hf_err.max())
    assert err.mean() <= 2 * hf_err.mean(), (err.mean(), hf_err.mean())


def test_bf16_chunked_prefill_reads_the_cache_in_place(qwen3_pair, monkeypatch):
    """A 70-token prompt in 32-token chunks (dcp=1): each chunk's context attention has 32 causal
    query rows, which the native kernel's AMX path reads through the block table with their bounds
    (no gathered copy). The logits after each chunk stay within bf16's tolerance of HF's fp32
    forward, as HF's own bf16 forward does."""
    from dcpgraph.ops import native

    fp32, bf16 = qwen3_pair
    if not native.available() or not native.amx_enabled(torch.bfloat16):
        pytest.skip(f"AMX bf16 path off: {native.amx_reason or native.reason}")
    prompt = torch.randint(1, 256, (70,), generator=torch.Generator().manual_seed(4)).tolist()
    bounded = []
    real = native._module.paged_attention  # argument 8: kv_bound; decode steps pass one too (one query a row)
    monkeypatch.setattr(native._module, "paged_attention",
                        lambda *a: bounded.append(a[0].shape[0] if a[8] is not None else 0) or real(*a))
    engine = dcpgraph.compile(bf16, tp=1, dcp=1, block_size=4, max_num_batched_tokens=32)
    steps = record_logits(engine)
    engine.generate([prompt], 1)
    assert max(bounded) == 32, "no chunk's context attention reached the kernel with its bounds"
    with torch.no_grad():
        truth = fp32(torch.tensor([prompt])).logits[0]
        hf = bf16(torch.tensor([prompt])).logits[0].float()
    ends = [31, 63, 69]  # the last position of each chunk: the logits each prefill step returns
    got = torch.stack([s[0].float().reshape(-1, truth.shape[-1])[-1] for s in steps[: len(ends)]])
    err, hf_err = (got - truth[ends]).abs(), (hf[ends] - truth[ends]).abs()
    assert err.max() <= 2 * hf_err.max(), (err.max(), hf_err.max())


def test_bf16_lse_and_merge_accumulate_in_fp32():
    q = torch.randn(3, 4, 16).bfloat16()
    k, v = torch.randn(5, 2, 16).bfloat16(), torch.randn(5, 2, 16).bfloat16()
    cu_q, cu_k = torch.tensor([0, 1, 3], dtype=torch.int32), torch.tensor([0, 2, 5], dtype=torch.int32)
    out, lse = ops.partial_attention(q, k, v, cu_q, cu_k, 0.25, False)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    merged, merged_lse = ops.merge_attention(torch.stack([out, out]), torch.stack([lse, lse]))
    assert merged_lse.dtype == torch.float32
    torch.testing.assert_close(merged_lse, lse + torch.log(torch.tensor(2.0)))


def _greedy_with_logits(engine, prompt, new):
    steps = record_logits(engine)
    tokens = engine.generate([prompt], new)[0]
    return tokens, [s[0].float() for s in steps]


def test_bf16_greedy_dcp2_equals_dcp1_where_margins_are_safe(qwen3_pair):
    _, bf16 = qwen3_pair
    prompt, new = [5, 17, 99, 3, 42, 7, 250, 11, 64], 24
    one = dcpgraph.compile(bf16, tp=1, dcp=1, block_size=4, max_num_batched_tokens=4)
    two = dcpgraph.compile(bf16, tp=2, dcp=2, block_size=4, max_num_batched_tokens=4)
    ref, logits = _greedy_with_logits(one, prompt, new)
    got = two.generate([prompt], new)[0]
    sampled = logits[-len(ref):]  # the steps that sampled (the last prefill chunk, then decode)
    assert len(got) == len(ref) == len(sampled)
    safe = 0
    for token, want, row in zip(got, ref, sampled):
        top2 = row.topk(2).values
        if token != want:  # the runs may part only where the dcp=1 run itself nearly tied
            assert top2[0] - top2[1] < SAFE_MARGIN, (token, want, top2)
            break
        safe += bool(top2[0] - top2[1] >= SAFE_MARGIN)
    assert safe >= 4, f"only {safe} equal positions had a safe margin: the test would be vacuous"


# -- the option --------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["fp8_e5m2", "float8_e4m3fn", torch.float8_e4m3fn, None, "FP8_E4M3", "fp16"])
def test_kv_cache_dtype_is_validated_before_any_work(bad):
    class NotAModelYet(torch.nn.Module):
        def forward(self, x):  # tracing this would fail: the option must be refused first
            raise AssertionError("traced")

    with pytest.raises(ConfigError, match=r"kv_cache_dtype must be one of \['auto', 'bf16', 'fp8_e4m3'\]"):
        dcpgraph.compile(NotAModelYet(), kv_cache_dtype=bad)


def test_vllm_spellings_name_the_same_caches():
    from dcpgraph.options import compile_options

    assert compile_options(kv_cache_dtype="fp8")["kv_cache_dtype"] == "fp8_e4m3"
    assert compile_options(kv_cache_dtype="bfloat16")["kv_cache_dtype"] == "bf16"
    assert compile_options()["kv_cache_dtype"] == "auto"


def test_bf16_cache_for_fp32_model():
    model = build_model("llama", dtype=torch.float32)
    engine = dcpgraph.compile(model, block_size=4, kv_cache_dtype="bf16", num_blocks=8)
    assert {c.dtype for c in engine.program.caches} == {torch.bfloat16}
    assert len(engine.generate([[1, 2, 3]], 4)[0]) == 4


# -- fp8 op-level ------------------------------------------------------------------------------
def test_quantize_roundtrip_error_is_e4m3s():
    x = torch.randn(7, 3, 200) * torch.logspace(-3, 3, 7).view(7, 1, 1)
    x[0, 0] = 0.0  # an all-zero row keeps scale 1 and dequantises to exactly 0
    q, scales = quant.quantize_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and scales.shape == (7, 3, 2) and scales.dtype == torch.float32
    back = quant.dequantize_fp8(q, scales, torch.float32)
    assert torch.equal(back[0, 0], torch.zeros(200)) and torch.all(scales[0, 0] == 1)
    # powers of two (frexp's mantissa 0.5), the smallest that keeps every group within e4m3's 448
    assert torch.all(torch.frexp(scales)[0] == 0.5)
    group_amax = torch.nn.functional.pad(x.abs(), (0, 56)).view(7, 3, 2, 128).amax(-1)
    nonzero = group_amax > 0
    assert torch.all(group_amax[nonzero] / scales[nonzero] <= 448)
    assert torch.all(group_amax[nonzero] / scales[nonzero] > 224)
    # exact in bf16: e4m3's 4 significant bits times a power of two
    assert torch.equal(back, back.to(torch.bfloat16).float())
    group_max = torch.stack([x[..., :128].abs().amax(-1), x[..., 128:].abs().amax(-1)], -1)
    bound = group_max.repeat_interleave(128, -1)[..., :200] * 2.0**-4
    assert torch.all((back - x).abs() <= bound + 1e-30)


def test_fp8_write_skips_unowned_slots_and_writes_scales():
    cache = torch.zeros(3, 4, 2, 16, dtype=torch.float8_e4m3fn)
    scales = torch.full((3, 4, 2, 1), -1.0)
    new = torch.randn(3, 2, 16)
    ops.kv_cache_write_fp8_(cache, new, torch.tensor([5, -1, 0]), scales)
    flat, flat_scales = cache.view(12, 2, 16), scales.view(12, 2, 1)
    q, s = quant.quantize_fp8(new)
    for slot, token in ((5, 0), (0, 2)):
        assert torch.equal(flat[slot].view(torch.uint8), q[token].view(torch.uint8))
        assert torch.equal(flat_scales[slot], s[token])
    untouched = [i for i in range(12) if i not in (0, 5)]
    assert torch.all(flat_scales[untouched] == -1) and torch.all(flat[untouched].float() == 0)


@pytest.mark.parametrize("latent", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_paged_attention_equals_attention_over_dequantised_cache(latent, dtype):
    gen = torch.Generator().manual_seed(1)
    nb, block, hkv, hq, d, dv = 10, 4, 1 if latent else 2, 4, 40 if latent else 16, 32 if latent else 16
    k = torch.randn(nb * block, hkv, d, generator=gen)
    v = torch.randn(nb * block, hkv, dv, generator=gen)
    kq, ks = quant.quantize_fp8(k)
    vq, vs = quant.quantize_fp8(v)
    shape = lambda t: t.view(nb, block, *t.shape[1:])  # noqa: E731
    k8, ks = shape(kq), shape(ks)
    v8, vs = (k8[..., :dv], None) if latent else (shape(vq), shape(vs))
    # The native kernel converts fp8 to fp32 in registers and rounds only its output to q's dtype;
    # the torch path dequantises into q's dtype. The reference reads the values the same way.
    from dcpgraph.ops import native, paged

    exact = torch.float32 if paged.native_enabled(torch.float8_e4m3fn) else dtype
    k_ref = quant.dequantize_fp8(k8, ks, exact)
    v_ref = k_ref[..., :dv] if latent else quant.dequantize_fp8(v8, vs, exact)
    table = torch.tensor([[7, 2, 9], [0, 5, 0], [3, 3, 3]], dtype=torch.int32)  # row 2: no keys
    lens = torch.tensor([11, 5, 0], dtype=torch.int32)
    for cu, rows in ((torch.arange(4, dtype=torch.int32), 3), (torch.tensor([0, 2, 5, 6], dtype=torch.int32), 6)):
        q = torch.randn(rows, hq, d, generator=gen).to(dtype)
        want = ops.paged_attention(q.to(exact), k_ref, v_ref, table, cu, lens, None, 0.3)
        want = (want[0].to(dtype), want[1])
        got = ops.paged_attention(q, k8, v8, table, cu, lens, None, 0.3, k_scales=ks, v_scales=vs)
        assert got[1].dtype == torch.float32
        # bf16 queries on the native AMX path round the softmax weights to bf16 for the value
        # product: equal within its stated tolerance. On the fp32 path, fp32 caches and fp8 rows of
        # one scale each (GQA here) take their softmax and value rows 64 tokens a span, while fp8
        # rows with several scale groups (the latent) go a block at a time: the same products, with
        # each row's max, sum and rescaling taken over other groupings of the tokens, so output and
        # LSE within fp32 rounding of each other. Every other case exactly.
        amx = dtype == torch.bfloat16 and exact == torch.float32 and native.amx_enabled(torch.float8_e4m3fn)
        one_block_at_a_time = latent and exact == torch.float32 and not amx
        out_tol, lse_tol = (native.AMX_OUT_TOL, native.AMX_LSE_TOL) if amx else (1e-6, 1e-6) if one_block_at_a_time else (0, 0)
        torch.testing.assert_close(got[0], want[0], rtol=out_tol, atol=out_tol)
        torch.testing.assert_close(got[1], want[1], rtol=lse_tol, atol=lse_tol)


def test_fp8_cache_without_scales_is_refused():
    cache = torch.zeros(2, 4, 1, 8, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="needs its scales"):
        ops.paged_attention(torch.randn(1, 1, 8), cache, cache, torch.zeros(1, 1, dtype=torch.int32),
                            torch.tensor([0, 1], dtype=torch.int32), torch.tensor([3], dtype=torch.int32), None, 1.0)


# -- fp8 end to end ----------------------------------------------------------------------------
@pytest.mark.parametrize("arch,tp,dcp", [("llama", 1, 1), ("llama", 2, 2), ("qwen3", 4, 2), ("deepseek_v3", 2, 2)])
def test_fp8_kv_bytes_agree_with_the_planner(arch, tp, dcp):
    model = build_model(arch, dtype=torch.bfloat16)
    shape = from_config(tiny_config(arch).to_dict())
    for kv in ("auto", "fp8_e4m3"):
        engine = dcpgraph.compile(model, tp=tp, dcp=dcp, block_size=4, num_blocks=6, kv_cache_dtype=kv)
        per_block = kv_bytes_per_block(engine.program)
        assert per_block == bytes_per_block(shape.cache_shapes(tp, kv), 4)
        assert per_block == bytes_per_block(cache_shapes(engine.program.caches), 4)
        report = engine.memory_report()
        assert report["kv_bytes_per_rank"][0] == per_block * 6
        if kv == "fp8_e4m3":
            data = [c for c in engine.program.caches if not c.role.endswith("_scale")]
            assert {c.dtype for c in data} == {torch.float8_e4m3fn}
            scale_bytes = sum(4 * c.heads * c.dim * 4 for c in engine.program.caches if c.role.endswith("_scale"))
            assert per_block == sum(4 * c.heads * c.dim for c in data) + scale_bytes


@pytest.mark.parametrize("arch,tp,dcp", [("qwen3", 2, 2), ("deepseek_v3", 2, 2)])
def test_fp8_engine_tracks_bf16_engine(arch, tp, dcp):
    """fp8 KV changes the logits by its quantisation error only: teacher-forced logits stay close to
    the bf16-KV engine's and mostly pick the same token (the tight figure is the benchmark's, on a
    trained model; these weights are random). Bounds on the typical row (median of each position's
    largest error) and the mean, not the maximum: a perturbation that flips a MoE router's choice
    (DeepSeek-V3 here) moves that one position's logits by a lot, with either cache dtype."""
    model = redraw(build_model(arch, dtype=torch.bfloat16), 4)
    tokens = torch.randint(1, 256, (32,), generator=torch.Generator().manual_seed(2)).tolist()
    base = dcpgraph.compile(model, tp=tp, dcp=dcp, block_size=4, max_num_batched_tokens=1, kv_cache_dtype="bf16")
    fp8 = dcpgraph.compile(model, tp=tp, dcp=dcp, block_size=4, max_num_batched_tokens=1, kv_cache_dtype="fp8_e4m3")
    want, got = teacher_forced_logits(base, tokens).float(), teacher_forced_logits(fp8, tokens).float()
    assert not torch.equal(want, got)  # the fp8 cache is really read
    scale, err = want.abs().max(), (got - want).abs()
    assert err.amax(-1).median() <= 0.1 * scale, (err.amax(-1).median(), scale)
    assert err.mean() <= 0.03 * scale, (err.mean(), scale)
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.8


def test_npu_lowering_refuses_fp8_caches():
    from dcpgraph.backends.npu import NpuLoweringError, lower_npu

    engine = dcpgraph.compile(build_model("llama", dtype=torch.bfloat16), block_size=4, num_blocks=4,
                              kv_cache_dtype="fp8_e4m3")
    with pytest.raises(NpuLoweringError, match=r"fp8 KV cache .* int8/int4 only on Atlas A2/A3"):
        lower_npu(engine.program.graph_module)


def test_fp8_kv_transfer_moves_values_and_scales():
    """P/D with fp8 caches: a prefill engine at dcp=1 hands its fp8 KV (and scales) to a decode
    engine at dcp=2; the tokens equal one fp8 engine's own run (fp64 weights: merge order cannot
    flip an argmax, and the fp8 bytes and scales are copied, not requantised)."""
    model = redraw(build_model("llama", dtype=torch.float64), 5)
    prompt, new = [3, 9, 27, 81, 243, 1, 2, 5, 11], 8
    options = dict(tp=2, block_size=4, num_blocks=16, kv_cache_dtype="fp8_e4m3")
    want = dcpgraph.compile(model, dcp=1, **options).generate([prompt], new)[0]
    transfer = dcpgraph.compile(model, dcp=1, **options).prefill(prompt)
    names = {name for rank in transfer.caches for name in rank}
    assert any(n.endswith("_scale") for n in names)
    assert {t.dtype for rank in transfer.caches for n, t in rank.items() if not n.endswith("_scale")} == {
        torch.float8_e4m3fn}
    decode = dcpgraph.compile(model, dcp=2, **options)
    rid = decode.continue_from(transfer, new)
    outputs = {}
    for _ in range(50):
        if not decode.scheduler.has_work():
            break
        for r, token, _ in decode.step():
            outputs.setdefault(r, []).append(token)
    assert [transfer.tokens[len(prompt)]] + outputs[rid] == want
