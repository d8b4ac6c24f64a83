"""MLAPO (the fused MLA preprocess): ``fuse_mla_preprocess`` and the ``dcpgraph.mla_preprocess`` op.

References, independent of the code under test:

* the op: a by-hand preprocess written here (rotary as explicit rotations of pairs, norms as
  formulas), on random inputs with some slots −1 (those rows must stay untouched);
* end to end: HF ``generate`` on the same fp64 weights, with ``mlapo`` on and off, at every valid
  (tp, dcp) of ``test_e2e_mla``'s selection (both interleaves, both comms, emulated), and the
  logits of one step with ``mlapo`` on equal bit for bit to those with it off;
* refusals: variants the pass does not match stay unfused, the provenance says why, and the
  tokens still equal HF's.
"""

from __future__ import annotations

import pytest
import torch
from mla_models import BLOCK_SIZE, CASES, MAX_BATCHED, MAX_NEW, PROMPTS, build, sizing

import dcpgraph
from dcpgraph import ConfigError
from dcpgraph.models import tiny_config
from dcpgraph.passes.fuse_mla_preprocess import fuse_mla_preprocess
from dcpgraph.passes.graph_edit import nodes_calling
from dcpgraph.testing.generation import hf_greedy, record_logits

ops = torch.ops.dcpgraph
FUSED = ops.mla_preprocess.default


def _summary(program) -> str:
    return next(p.summary for p in program.provenance if p.name == "fuse_mla_preprocess")


def _count(program, op) -> int:
    return len(nodes_calling(program.graph_module.graph, op))


# -- 1. the op against a by-hand preprocess ------------------------------------------------------
def _by_hand(x, q_a, q_a_norm, q_b, kv_a, kv_norm, w_uk, rot, rot_sin, q_eps, kv_eps, kind):
    """The preprocess written independently: norms in fp32, rotary as pair rotations by angle."""
    rank, nope = kv_norm.shape[0], w_uk.shape[1]
    rope = kv_a.shape[0] - rank

    def norm(v, w, eps):
        v32 = v.float()
        return w * (v32 / torch.sqrt((v32 * v32).mean(-1, keepdim=True) + eps)).to(v.dtype)

    def rotate(v):  # v [..., T, rope]; pairs by kind; output layout as HF's
        t = v.shape[-2]
        if kind == "complex":
            z = torch.complex(v[..., 0::2].float(), v[..., 1::2].float()) * rot.reshape(t, rope // 2)
            return torch.stack([z.real, z.imag], -1).flatten(-2).to(v.dtype)
        half = rot.reshape(t, rope)[:, : rope // 2], rot_sin.reshape(t, rope)[:, : rope // 2]
        cos, sin = half
        a, b = (v[..., 0::2], v[..., 1::2]) if kind == "interleave" else (v[..., : rope // 2], v[..., rope // 2:])
        return torch.cat([a * cos - b * sin, b * cos + a * sin], -1)

    q_c = norm(x @ q_a.T, q_a_norm, q_eps) if q_a is not None else x
    q = (q_c @ q_b.T).reshape(x.shape[1], -1, nope + rope).transpose(0, 1)  # [H, T, nope+rope]
    ckv = x[0] @ kv_a.T
    c = norm(ckv[:, :rank], kv_norm, kv_eps)
    kv = torch.cat([c, rotate(ckv[:, rank:])], -1)  # [T, R+rope]
    q_lat = torch.cat([torch.einsum("htn,hnr->htr", q[..., :nope], w_uk), rotate(q[..., nope:])], -1)
    return q_lat.unsqueeze(0), kv.view(1, 1, *kv.shape), (q_c if q_a is not None else None)


@pytest.mark.parametrize("kind", ["interleave", "rotate_half", "complex"])
@pytest.mark.parametrize("q_lora", [True, False])
def test_fused_op_equals_by_hand_preprocess_and_skips_slot_minus_one(kind, q_lora):
    gen = torch.Generator().manual_seed(3)
    d, heads, nope, rope, rank, q_rank, t = 48, 3, 16, 8, 32, 24, 7
    f64 = torch.float64

    def rnd(*shape, mean=0.0):
        return mean + 0.3 * torch.randn(*shape, generator=gen, dtype=f64)

    x = rnd(1, t, d)
    q_a, q_a_norm = (rnd(q_rank, d), rnd(q_rank, mean=1.0)) if q_lora else (None, None)
    q_b = rnd(heads * (nope + rope), q_rank if q_lora else d)
    kv_a, kv_norm, w_uk = rnd(rank + rope, d), rnd(rank, mean=1.0), rnd(heads, nope, rank)
    angles = torch.rand(1, t, rope // 2, generator=gen, dtype=torch.float32) * 6
    if kind == "complex":
        rot, rot_sin = torch.polar(torch.ones_like(angles), angles), None
    else:
        rot, rot_sin = (torch.cat([f(angles), f(angles)], -1).to(f64) for f in (torch.cos, torch.sin))
    cache = rnd(5, 4, 1, rank + rope)  # 20 slots, prefilled: untouched rows must keep their values
    slots = torch.tensor([3, -1, 17, 0, -1, 9, 12])
    before = cache.clone()
    q_lat, kv, q_c = ops.mla_preprocess(x, q_a, q_a_norm, q_b, kv_a, kv_norm, w_uk, rot, rot_sin, cache, slots,
                                        1e-6, 2e-6, kind)
    want_q, want_kv, want_qc = _by_hand(x, q_a, q_a_norm, q_b, kv_a, kv_norm, w_uk, rot, rot_sin, 1e-6, 2e-6, kind)
    rtol, atol = 1e-5, 1e-6  # the norms (and the complex rotary) compute in fp32, as HF's
    torch.testing.assert_close(q_lat, want_q, rtol=rtol, atol=atol)
    torch.testing.assert_close(kv, want_kv, rtol=rtol, atol=atol)
    if q_lora:
        torch.testing.assert_close(q_c, want_qc, rtol=rtol, atol=atol)
    else:
        assert q_c.numel() == 0
    rows, old = cache.view(-1, rank + rope), before.view(-1, rank + rope)
    for token, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(rows[slot], kv[0, 0, token])
    untouched = sorted(set(range(20)) - {s for s in slots.tolist() if s >= 0})
    assert torch.equal(rows[untouched], old[untouched])
    # the fake kernel agrees on shapes and dtypes
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fakes = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
                 for a in (x, q_a, q_a_norm, q_b, kv_a, kv_norm, w_uk, rot, rot_sin, cache, slots)]
        shapes = [(o.shape, o.dtype) for o in ops.mla_preprocess(*fakes, 1e-6, 2e-6, kind)]
    assert shapes == [(o.shape, o.dtype) for o in (q_lat, kv, q_c)]


# -- 2. the pass: structure, option, provenance --------------------------------------------------
@pytest.fixture(scope="module")
def programs():
    return {name: dcpgraph.trace(build(name)) for name in ("deepseek_v2", "deepseek_v3")}


@pytest.mark.parametrize(("name", "variant"), [("deepseek_v2", "q_proj, complex rotary"),
                                               ("deepseek_v3", "q_lora, interleave rotary")])
def test_pass_fuses_every_layer_and_the_option_turns_it_off(programs, name, variant):
    on = dcpgraph.compile(programs[name], tp=2, dcp=2, block_size=BLOCK_SIZE, num_blocks=8).program
    off = dcpgraph.compile(programs[name], tp=2, dcp=2, block_size=BLOCK_SIZE, num_blocks=8, mlapo=False).program
    assert _count(on, FUSED) == 2 and _count(on, ops.kv_cache_write_.default) == 0
    assert _count(off, FUSED) == 0 and _count(off, ops.kv_cache_write_.default) == 2
    assert _summary(on) == f"2 MLA layers fused into mla_preprocess ({variant})"
    assert _summary(off) == "mlapo=False: MLA preprocess left unfused"
    # the projections are gone from the graph: one op per layer holds them
    linears = {n.args[1].name for n in nodes_calling(on.graph_module.graph, torch.ops.aten.linear.default)}
    assert not any("kv_a_proj" in w or "q_proj" in w or "q_a_proj" in w or "q_b_proj" in w for w in linears)
    # the fused op reads this rank's heads: TP-local q weights and W_UK (8 heads / tp=2)
    for node in nodes_calling(on.graph_module.graph, FUSED):
        assert node.args[6].meta["val"].shape[0] == 4 and node.meta["val"][0].shape[1] == 4
        assert node.args[9].name.startswith("latent_cache_") and node.args[10].name == "slot_mapping"
    with pytest.raises(ConfigError, match="mlapo must be True or False"):
        dcpgraph.compile(programs[name], tp=1, mlapo="yes")


def test_one_step_logits_are_bit_identical_with_and_without_mlapo(programs):
    for name in programs:
        engines = [dcpgraph.compile(programs[name], tp=2, dcp=2, block_size=BLOCK_SIZE, num_blocks=16,
                                    max_num_batched_tokens=MAX_BATCHED, mlapo=m) for m in (True, False)]
        logits = []
        for engine in engines:
            seen = record_logits(engine)
            engine.generate([list(PROMPTS[2]), list(PROMPTS[3])], 3)
            logits.append(seen)
        assert len(logits[0]) == len(logits[1]) >= 3
        for a, b in zip(*logits):
            assert torch.equal(a, b), name


@pytest.mark.parametrize("name", ["deepseek_v2", "deepseek_v3"])
def test_fused_program_equals_unfused_program_on_a_random_step(programs, name):
    """The per-rank programs with and without MLAPO, on one step with random caches (a decode row
    after 9 tokens, a 3-token chunk after 2, a 5-token prefill): logits and every cache bit-identical
    on every rank, the slots −1 (tokens another DCP rank owns) untouched."""
    from dcpgraph.passes.pipeline import compile_program
    from dcpgraph.runtime.emulator import run_spmd
    from dcpgraph.runtime.executors import allocate_caches, rank_arguments
    from dcpgraph.runtime.step_inputs import Chunk, build_step_inputs

    mesh = dcpgraph.Mesh(2, 2)
    compiled = {m: compile_program(programs[name], mesh, block_size=BLOCK_SIZE, comm="ag_rs", mlapo=m)
                for m in (True, False)}
    assert _count(compiled[True], FUSED) == 2 and _count(compiled[False], FUSED) == 0
    chunks = [Chunk(0, (5,), 9, (0, 1)), Chunk(1, (7, 8, 9), 2, (2,)), Chunk(2, (1, 2, 3, 4, 6), 0, (3,))]
    shared, per_rank = build_step_inputs(chunks, mesh, BLOCK_SIZE, 1)
    assert all((per_rank[r]["slot_mapping"] == -1).any() for r in mesh.ranks)
    gen = torch.Generator().manual_seed(21)
    initial = {k: torch.randn(v.shape, generator=gen, dtype=v.dtype)
               for k, v in allocate_caches(compiled[True], 6).items()}
    results = {}
    for m, program in compiled.items():
        caches = {r: {k: v.clone() for k, v in initial.items()} for r in mesh.ranks}
        args = [rank_arguments(program, program.local_state(r), caches[r], shared, per_rank[r]) for r in mesh.ranks]
        outs = run_spmd(program.graph_module, args, mesh)
        results[m] = ([o[0] if isinstance(o, (tuple, list)) else o for o in outs], caches)
    for r in mesh.ranks:
        assert torch.equal(results[True][0][r], results[False][0][r]), r
        for key in initial:
            assert torch.equal(results[True][1][r][key], results[False][1][r][key]), (r, key)
            written = (results[True][1][r][key] != initial[key]).flatten(0, 1).any(-1).any(-1)
            owned = per_rank[r]["slot_mapping"][per_rank[r]["slot_mapping"] >= 0]
            assert sorted(written.nonzero().flatten().tolist()) == sorted(owned.tolist()), (r, key)


# -- 3. greedy tokens equal HF's, mlapo on and off ------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("mlapo", [True, False])
@pytest.mark.parametrize(
    ("name", "tp", "dcp", "interleave", "comm"), CASES,
    ids=[f"{n.removeprefix('deepseek_')}-tp{t}-dcp{d}-il{i}-{c}" for n, t, d, i, c in CASES],
)
def test_greedy_matches_hf_with_and_without_mlapo(programs, name, tp, dcp, interleave, comm, mlapo):
    engine = dcpgraph.compile(programs[name], tp=tp, dcp=dcp, interleave=interleave, comm=comm,
                              block_size=BLOCK_SIZE, max_num_batched_tokens=MAX_BATCHED, mlapo=mlapo,
                              **sizing(dcp, interleave))
    assert _count(engine.program, FUSED) == (2 if mlapo else 0)
    got = engine.generate([list(p) for p in PROMPTS], MAX_NEW)
    for prompt, tokens in zip(PROMPTS, got):
        assert tokens == _reference(name, prompt), f"prompt of length {len(prompt)}"


_REFERENCES: dict = {}


def _reference(name: str, prompt) -> list[int]:
    """HF ``generate`` on ``build(name)``'s weights (the model the traced programs came from)."""
    key = (name, tuple(prompt))
    if key not in _REFERENCES:
        _REFERENCES[key] = hf_greedy(build(name), prompt, MAX_NEW)
    return _REFERENCES[key]


# -- 4. what the pass does not match stays unfused, with the reason -------------------------------
def _variant(**overrides) -> torch.nn.Module:
    """DeepSeek-V3 tiny with config overrides, weights redrawn as test_e2e_mla.build does."""
    import transformers as tf

    config = tiny_config("deepseek_v3")
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config).to(torch.float64).eval()
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            scale = (1.0, 0.3) if "norm" in pname else (0.0, 0.2)
            p.copy_(scale[0] + scale[1] * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return model


def _tokens_match_hf(model, engine) -> None:
    prompts = [list(PROMPTS[1]), list(PROMPTS[3])]
    for prompt, got in zip(prompts, engine.generate(prompts, 8)):
        assert got == hf_greedy(model, prompt, 8)


def test_rotate_half_rotary_is_fused_and_exact():
    model = _variant(rope_interleave=False)
    engine = dcpgraph.compile(model, tp=2, dcp=2, block_size=BLOCK_SIZE, max_num_batched_tokens=MAX_BATCHED)
    assert _summary(engine.program) == "2 MLA layers fused into mla_preprocess (q_lora, rotate_half rotary)"
    _tokens_match_hf(model, engine)


def test_biased_projections_are_left_unfused_with_the_reason():
    model = _variant(attention_bias=True)  # q_a_proj / kv_a_proj_with_mqa with a bias: no variant has one
    engine = dcpgraph.compile(model, tp=2, dcp=2, block_size=BLOCK_SIZE, max_num_batched_tokens=MAX_BATCHED)
    summary = _summary(engine.program)
    assert summary.startswith("0 MLA layers fused into mla_preprocess; left unfused: layer 0 (latent_cache_0): ")
    assert "match no MLA preprocess variant (q_a_proj → norm → q_b_proj; rotary tried: " in summary
    assert "layer 1 (latent_cache_1)" in summary
    assert _count(engine.program, FUSED) == 0 and _count(engine.program, ops.kv_cache_write_.default) == 2
    _tokens_match_hf(model, engine)


def test_fp8_cache_and_escaping_intermediates_are_refused(programs):
    fp8 = dcpgraph.compile(programs["deepseek_v3"], tp=1, block_size=BLOCK_SIZE, num_blocks=8,
                           kv_cache_dtype="fp8_e4m3").program
    assert _count(fp8, FUSED) == 0
    assert "layer 0 (latent_cache_0): an fp8 latent cache (mla_preprocess writes unquantised rows)" in _summary(fp8)
    # an intermediate read elsewhere (here: the compressed-KV norm made a graph output) is refused;
    # fuse_linears off, so q_a/kv_a stay the separate linears fuse_mla_preprocess sees in the pipeline
    off = dcpgraph.compile(programs["deepseek_v3"], tp=2, dcp=2, block_size=BLOCK_SIZE, num_blocks=8,
                           mlapo=False, fuse_linears=False).program
    gm = off.copy_graph()
    graph = gm.graph
    weight = next(n for n in graph.nodes if n.op == "placeholder" and n.name.endswith("layers_1_self_attn_kv_a_layernorm_weight"))
    normed = next(iter(weight.users))
    out = next(n for n in graph.nodes if n.op == "output")
    out.args = ((*out.args[0], normed),)
    gm.recompile()
    probe = off.replace(graph_module=gm)
    fused, summary = fuse_mla_preprocess.body(probe)
    assert summary == (f"1 MLA layers fused into mla_preprocess (q_lora, interleave rotary); left unfused: "
                       f"layer 1 (latent_cache_1): intermediate ['{normed.name}'] also read outside the preprocess")
    assert _count(fused, FUSED) == 1


def test_gqa_programs_are_untouched():
    from dcpgraph.models import build_model

    engine = dcpgraph.compile(build_model("llama"), tp=2, dcp=2, block_size=BLOCK_SIZE, num_blocks=8)
    assert _summary(engine.program) == "not an MLA model: no MLA preprocess to fuse"
    assert _count(engine.program, FUSED) == 0
