"""End-to-end acceptance tests of the MLA slice: DeepSeek HF model → ``dcpgraph.compile``.

Models: ``dcpgraph.models.build_model("deepseek_v2" | "deepseek_v3")`` — 2 layers (layer 0 dense,
layer 1 MoE with 4 routed experts, top-2, one shared expert), 8 query heads, ``kv_lora_rank`` 32,
rope 8, nope 16, v 16, vocab 256, fp64. V2 has no ``q_lora_rank`` (``q_proj``), V3 has
``q_lora_rank`` 24 (``q_a_proj`` → norm → ``q_b_proj``) and the biased group router. HF's init
(std 0.02) makes attention almost uniform, so that ``kv_b_proj`` of layer 1 barely reaches the
logits; :func:`build` therefore redraws every weight from N(0, 0.2), the norm weights from
N(1, 0.3) and V3's ``e_score_correction_bias`` from N(0, 0.1) (seeded). HF's own ``generate``
runs the fp64 model with eager experts; dcpgraph traces it with ``batched_mm`` experts. Note that
HF's RMSNorm computes in fp32 and the router casts to fp32, so the residual stream is re-rounded to
fp32 precision at every norm: fp64 keeps argmax ties away, and most reorderings vanish bit-for-bit.

Reference: HF ``generate(do_sample=False)`` prompt by prompt (computed once per model and prompt).

Config selection for the greedy test (:func:`covering_selection`, deterministic):

* every valid ``(tp, dcp)`` in ``{1,2,4}²`` (MLA rule ``tp % dcp == 0``, enumerated with
  ``Mesh.validate``): (1,1) (2,1) (2,2) (4,1) (4,2) (4,4), for both models;
* ``dcp == 1``: one run, interleave 1 (the program and layout do not depend on interleave or comm
  there; ``comm`` is rotated only for variety);
* ``dcp > 1``: two runs, interleave 1 and interleave ``block_size``, with different comms; the comm
  of the interleave-1 run alternates ``a2a``/``ag_rs`` over the model's successive ``dcp > 1`` pairs,
  starting from the model's index. So every such pair sees both interleaves and both comms, and
  each model sees all four ``(interleave, comm)`` combinations:
  V2: (2,2) il1 a2a, il4 ag_rs; (4,2) il1 ag_rs, il4 a2a; (4,4) il1 a2a, il4 ag_rs;
  V3: the same with a2a ↔ ag_rs. 18 runs in all.

KV sizing of those runs (reused by the memory test): ``dcp == 1`` and interleave-1 runs get
``num_blocks=NUM_BLOCKS``; interleave-``block_size`` runs with ``dcp > 1`` get
``kv_cache_tokens=NUM_BLOCKS·block_size`` — the capacity of the dcp=1 engines. Every run uses one
batch of prompts of lengths 1, 3, 6, 19 (1 and 3 are shorter than ``dcp·interleave`` for several
runs; 19 > ``max_num_batched_tokens`` = 8 so prefill is chunked and mixed with decode rows),
``block_size`` 4 and 20 new tokens: every request crosses at least one virtual block (``4·dcp``
tokens), and the 19-token prompt crosses a rank-local block boundary on every rank of every mesh.

Also covered: the absorbed program equals the decompressed one and HF's forward (logits, fp64,
several token counts); the latent KV memory formula; ``explain`` shows the latent caches and the
absorbed projections; the routed experts and the router are replicated under TP, and the router's
top-k choices are the same on every rank and equal to HF's.
"""

from __future__ import annotations

import itertools
import operator
import re
from fractions import Fraction

import pytest
import torch
from mla_models import (
    BLOCK_SIZE,
    CASES,
    COMMS,
    EXPECTED_VALID,
    HEADS,
    INTERLEAVES,
    KV_LORA_RANK,
    LAYERS,
    MAX_BATCHED,
    MAX_NEW,
    MODELS,
    MOE_LAYERS,
    NOPE,
    NUM_BLOCKS,
    PROMPTS,
    ROPE,
    V_DIM,
    VOCAB,
    build,
    case_for,
    sizing,
    valid_meshes,
)

import dcpgraph
from dcpgraph import layout
from dcpgraph.passes.absorb_mla import absorb_mla
from dcpgraph.passes.manager import run_passes
from dcpgraph.program import STATE_KINDS, USER
from dcpgraph.testing.generation import hf_greedy, hf_reference

aten = torch.ops.aten

# -- fixtures -----------------------------------------------------------------------------------
class Zoo:
    """Each model built and traced once; HF references and engines cached."""

    def __init__(self) -> None:
        self._models: dict[str, torch.nn.Module] = {}
        self._programs: dict = {}
        self._refs: dict[tuple[str, tuple[int, ...]], list[int]] = {}
        self._engines: dict[tuple, dcpgraph.Engine] = {}

    def model(self, name: str) -> torch.nn.Module:
        if name not in self._models:
            self._models[name] = build(name)
        return self._models[name]

    def program(self, name: str):
        if name not in self._programs:
            self._programs[name] = dcpgraph.trace(self.model(name))
        return self._programs[name]

    def reference(self, name: str, prompt) -> list[int]:
        key = (name, tuple(prompt))
        if key not in self._refs:
            self._refs[key] = hf_greedy(self.model(name), prompt, MAX_NEW)
        return self._refs[key]

    def engine(self, name: str, tp: int, dcp: int, interleave: int, comm: str, mlapo: bool = True) -> dcpgraph.Engine:
        """The engine of one selected run (compiled once; memory, explain and TP tests reuse it)."""
        key = (name, tp, dcp, interleave, comm, mlapo)
        if key not in self._engines:
            self._engines[key] = dcpgraph.compile(
                self.program(name), tp=tp, dcp=dcp, interleave=interleave, comm=comm, mlapo=mlapo,
                block_size=BLOCK_SIZE, max_num_batched_tokens=MAX_BATCHED, **sizing(dcp, interleave),
            )
        return self._engines[key]


@pytest.fixture(scope="module")
def zoo() -> Zoo:
    return Zoo()


# -- the selection itself -------------------------------------------------------------------------
def test_valid_meshes_and_the_selection_covers_them(zoo):
    assert valid_meshes() == EXPECTED_VALID
    for name in MODELS:
        facts = zoo.program(name).facts
        assert (facts.attention, facts.num_q_heads, facts.num_kv_heads, facts.num_layers) == ("mla", HEADS, 1, LAYERS)
        assert (facts.extra["kv_lora_rank"], facts.extra["qk_rope_head_dim"], facts.extra["qk_nope_head_dim"],
                facts.v_head_dim) == (KV_LORA_RANK, ROPE, NOPE, V_DIM)
        assert facts.extra["q_lora_rank"] == (None if name == "deepseek_v2" else 24)
        runs = [c[1:] for c in CASES if c[0] == name]
        assert {(tp, dcp) for tp, dcp, _, _ in runs} == set(EXPECTED_VALID)
        for tp, dcp in EXPECTED_VALID:
            mine = [(i, c) for t, d, i, c in runs if (t, d) == (tp, dcp)]
            if dcp > 1:
                assert {i for i, _ in mine} == set(INTERLEAVES) and {c for _, c in mine} == set(COMMS)
            else:
                assert len(mine) == 1
        assert {(i, c) for _, d, i, c in runs if d > 1} == set(itertools.product(INTERLEAVES, COMMS))
    assert len(CASES) == 18
    # prompts: a 1-token one, ones shorter than dcp·interleave, a chunked one
    lengths = sorted(len(p) for p in PROMPTS)
    assert lengths[0] == 1 and lengths[-1] > MAX_BATCHED
    assert sum(n < 2 * 1 for n in lengths) == 1  # dcp·interleave = 2 (dcp=2, interleave 1)
    assert sum(n < 4 * BLOCK_SIZE for n in lengths) == 3  # dcp·interleave = 16
    for _, _tp, dcp, il, _ in CASES:
        assert all(len(p) + MAX_NEW > BLOCK_SIZE * dcp for p in PROMPTS)  # a virtual block boundary
        longest = len(PROMPTS[-1]) + MAX_NEW - 1  # tokens written to the cache
        assert all(layout.local_len(longest, r, dcp, il) > BLOCK_SIZE for r in range(dcp))


def test_references_are_not_degenerate(zoo):
    for name in MODELS:
        refs = [zoo.reference(name, p) for p in PROMPTS]
        assert all(len(r) == MAX_NEW and len(set(r)) >= 8 for r in refs), (name, refs)
        assert len({tuple(r) for r in refs}) == len(refs)


# -- 1. greedy tokens equal HF's ------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "tp", "dcp", "interleave", "comm"), CASES,
    ids=[f"{n.removeprefix('deepseek_')}-tp{t}-dcp{d}-il{i}-{c}" for n, t, d, i, c in CASES],
)
def test_greedy_matches_hf(zoo, name, tp, dcp, interleave, comm):
    engine = zoo.engine(name, tp, dcp, interleave, comm)
    got = engine.generate([list(p) for p in PROMPTS], MAX_NEW)
    for prompt, tokens in zip(PROMPTS, got):
        assert tokens == zoo.reference(name, prompt), f"prompt of length {len(prompt)}"
    report = engine.report()
    assert report["executor"] == "emulated"
    assert report["comm"] == (comm if dcp > 1 else "none")
    assert engine.blocks.free_blocks == engine.blocks.num_blocks
    assert not engine.scheduler.has_work()
    assert engine.steps >= MAX_NEW + 2  # the 19-token prompt was prefilled in chunks of <= 8


@pytest.mark.parametrize(("name", "tp", "dcp", "interleave", "comm"),
                         [("deepseek_v2", 4, 4, 1, "a2a"), ("deepseek_v3", 4, 2, BLOCK_SIZE, "ag_rs")])
def test_the_split_new_token_form_matches_hf_too(zoo, name, tp, dcp, interleave, comm):
    """``fuse_new_tokens=False`` (the Ascend backends' form) gives HF's tokens like the fused read."""
    engine = dcpgraph.compile(zoo.program(name), tp=tp, dcp=dcp, interleave=interleave, comm=comm,
                              block_size=BLOCK_SIZE, max_num_batched_tokens=MAX_BATCHED, **sizing(dcp, interleave),
                              fuse_new_tokens=False)
    ops = [n.target for n in engine.program.graph_module.graph.nodes]
    assert ops.count(torch.ops.dcpgraph.partial_attention.default) == LAYERS
    got = engine.generate([list(p) for p in PROMPTS], MAX_NEW)
    for prompt, tokens in zip(PROMPTS, got):
        assert tokens == zoo.reference(name, prompt), f"prompt of length {len(prompt)}"


# -- 2. absorbed == decompressed == HF ------------------------------------------------------------
def _logits(program, ids: torch.Tensor, positions: torch.Tensor, state=None) -> torch.Tensor:
    """Run a (pre-cache) Program's graph on one sequence; logits [1, T, V]."""
    state = program.state if state is None else state
    user = {"input_ids": ids, "position_ids": positions}
    args = []
    for spec in program.inputs:
        assert spec.kind in (*STATE_KINDS, USER), spec
        args.append(state[spec.target] if spec.kind in STATE_KINDS else user[spec.target])
    out = program.graph_module(*args)
    return out[0] if isinstance(out, (tuple, list)) else out


@pytest.mark.parametrize("name", MODELS)
def test_absorbed_program_equals_decompressed_and_hf(zoo, name):
    model, traced = zoo.model(name), zoo.program(name)
    absorbed = run_passes(traced, [absorb_mla])
    assert absorbed.provenance[-1].name == "absorb_mla"
    # the decompressed program attends over 8 heads of nope+rope; the absorbed one over 1 latent head
    f = absorbed.facts
    assert (f.num_kv_heads, f.head_dim, f.v_head_dim) == (1, KV_LORA_RANK + ROPE, KV_LORA_RANK)
    assert (traced.facts.head_dim, traced.facts.v_head_dim) == (NOPE + ROPE, V_DIM)
    for program, (kv_heads, k_dim, v_dim) in ((traced, (HEADS, NOPE + ROPE, V_DIM)),
                                              (absorbed, (1, KV_LORA_RANK + ROPE, KV_LORA_RANK))):
        attn = [n for n in program.graph_module.graph.nodes if n.target is torch.ops.dcpgraph.attention.default]
        assert len(attn) == LAYERS
        for node in attn:
            k, v = (a.meta["val"] for a in node.args[1:3])
            assert (k.shape[1], k.shape[-1], v.shape[1], v.shape[-1]) == (kv_heads, k_dim, kv_heads, v_dim)
    for layer in range(LAYERS):
        prefix = f"model.layers.{layer}.self_attn.kv_b_proj"
        assert prefix + ".weight" in traced.state and prefix + ".weight" not in absorbed.state
        w = traced.state[prefix + ".weight"].view(HEADS, NOPE + V_DIM, KV_LORA_RANK)
        assert torch.equal(absorbed.state[prefix + ".absorbed_uk"], w[:, :NOPE])
        assert torch.equal(absorbed.state[prefix + ".absorbed_uv_t"], w[:, NOPE:].transpose(1, 2))
    gen = torch.Generator().manual_seed(5)
    for tokens in (1, 3, 8, 21):
        ids = torch.randint(1, VOCAB, (1, tokens), generator=gen)
        # Consecutive positions from a random start: HF reads any other position pattern as
        # packed sequences (a different mask), dcpgraph's attention is causal by index.
        positions = int(torch.randint(0, 1000, (), generator=gen)) + torch.arange(tokens).unsqueeze(0)
        with torch.no_grad(), hf_reference(model):
            hf = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        dec = _logits(traced, ids, positions)
        lat = _logits(absorbed, ids, positions)
        assert lat.shape == dec.shape == hf.shape == (1, tokens, VOCAB)
        torch.testing.assert_close(lat, dec, rtol=0, atol=1e-10)
        torch.testing.assert_close(dec, hf, rtol=0, atol=1e-10)
        torch.testing.assert_close(lat, hf, rtol=0, atol=1e-10)
    # not vacuous: the logits do depend on every absorbed projection
    for key in [k for k in absorbed.state if k.endswith((".absorbed_uk", ".absorbed_uv_t"))]:
        state = dict(absorbed.state)
        state[key] = state[key] * (1 + 1e-6)
        assert (_logits(absorbed, ids, positions, state) - lat).abs().max() > 1e-9, key


# -- 3. KV memory --------------------------------------------------------------------------------
def _allocated(engine, rank: int) -> int:
    return sum(t.numel() * t.element_size() for t in engine.executor.caches[rank].values())


@pytest.mark.parametrize("name", MODELS)
def test_latent_kv_bytes_formula(zoo, name):
    """Per token: ``layers·(kv_lora_rank + rope)·8 / dcp`` bytes on each rank, whatever tp (the
    latent head is replicated over TP, only DCP shards it). The engines are the greedy runs':
    against the dcp=1 engine of the same tp, an interleave-1 run has the same ``num_blocks`` (so
    the same bytes per rank and dcp× the capacity) and an interleave-``block_size`` run the same
    token capacity (so 1/dcp of the bytes per rank). The reports match the allocated tensors."""
    dtype_bytes = torch.empty((), dtype=torch.float64).element_size()
    per_token = LAYERS * (KV_LORA_RANK + ROPE) * dtype_bytes  # 640 B at dcp=1
    engines = {c[1:]: zoo.engine(*c) for c in CASES if c[0] == name}
    reports = {key: e.memory_report() for key, e in engines.items()}
    base_bytes = NUM_BLOCKS * BLOCK_SIZE * per_token  # a dcp=1 engine, per rank
    for key, rep in reports.items():
        tp, dcp, il, _ = key
        engine = engines[key]
        assert (rep["tp"], rep["dcp"], rep["block_size"]) == (tp, dcp, BLOCK_SIZE)
        assert rep["kv_bytes_per_token"] == Fraction(per_token, dcp)
        assert rep["kv_bytes_per_token"] * dcp == per_token
        assert [(c.name, c.role, c.heads, c.dim) for c in engine.program.caches] == [
            (f"latent_cache_{i}", "latent", 1, KV_LORA_RANK + ROPE) for i in range(LAYERS)]
        assert [_allocated(engine, r) for r in range(tp)] == rep["kv_bytes_per_rank"]
        assert len(set(rep["kv_bytes_per_rank"])) == 1
        (dcp1,) = [r for (t, d, _, _), r in reports.items() if (t, d) == (tp, 1)]
        if dcp == 1 or il == 1:  # same num_blocks as the dcp=1 engine
            assert rep["num_blocks"] == dcp1["num_blocks"] == NUM_BLOCKS
            assert rep["kv_bytes_per_rank"] == dcp1["kv_bytes_per_rank"] == [base_bytes] * tp
            assert rep["kv_capacity_tokens"] == dcp * dcp1["kv_capacity_tokens"]
        else:  # same token capacity as the dcp=1 engine
            assert rep["num_blocks"] == NUM_BLOCKS // dcp
            assert rep["kv_capacity_tokens"] == dcp1["kv_capacity_tokens"] == NUM_BLOCKS * BLOCK_SIZE
            assert [b * dcp for b in rep["kv_bytes_per_rank"]] == dcp1["kv_bytes_per_rank"]
    # TP does not shrink the latent cache: same dcp and sizing → same bytes per rank at any tp
    for dcp in (1, 2):
        same = {reports[k]["kv_bytes_per_rank"][0] for k in reports if k[1] == dcp and k[2] == 1}
        assert len(same) == 1


# -- 4. explain -----------------------------------------------------------------------------------
def test_explain_shows_latent_cache_and_absorbed_projections(zoo):
    """Unfused (mlapo=False), so W_UK and the cache write are visible as their own ops; with MLAPO
    they are arguments of one ``mla_preprocess`` per layer (tests/test_mlapo.py)."""
    name = "deepseek_v3"
    engine = zoo.engine(*case_for(name, 2, 2), mlapo=False)
    text = dcpgraph.explain(engine)
    lines = text.splitlines()
    assert lines[0].startswith("# DeepseekV3ForCausalLM: mla attention, 2 layers, 8 q heads / 1 kv heads, "
                               "head dim 40 (v 32)")
    for layer in range(LAYERS):
        assert f"    %latent_cache_{layer}: layer {layer} latent, [blocks, 4, 1, 40] float64" in lines
        uk = f"%p_model_layers_{layer}_self_attn_kv_b_proj_absorbed_uk"
        uv = f"%p_model_layers_{layer}_self_attn_kv_b_proj_absorbed_uv_t"
        # W_UK absorbed into the query (4 local heads of 8 at tp=2, 6 example tokens, latent 32),
        # W_UV applied to the merged latent output (v 16)
        assert any(re.fullmatch(rf"  %\w+ = aten\.matmul\(%\w+, {uk}\) : \[1, 4, 6, 32\] float64", ln)
                   for ln in lines), uk
        assert any(re.fullmatch(rf"  %\w+ = aten\.matmul\(%\w+, {uv}\) : \[1, 4, 6, 16\] float64", ln)
                   for ln in lines), uv
        cache = f"%latent_cache_{layer}"
        assert any(re.fullmatch(rf"  %\w+ = dcpgraph\.kv_cache_write_\({cache}, %\w+, %slot_mapping\) : None", ln)
                   for ln in lines)
        values = [ln for ln in lines if re.fullmatch(rf"  %\w+ = aten\.slice\.Tensor\({cache}, -1, 0, 32\) .*", ln)]
        assert len(values) == 1  # the values are a view: the first 32 dims of the latent cache
        value = values[0].split()[0]
        # queries gathered over the DCP group (8 = 2 ranks x 4 heads), latent key and value caches, this
            # rank's counts of keys and causal bounds (context and new tokens in one read)
        assert any(re.fullmatch(rf"  %\w+ = dcpgraph\.paged_attention\(%\w+, {cache}, {value}, %block_table, "
                                r"%cu_seqlens_q, %\w+, %\w+, [\d.]+\) : "
                                r"\(\[6, 8, 32\] float64, \[6, 8\] float64\)", ln) for ln in lines)
    assert not re.search(r"%[kv]_cache_\d", text)  # no decompressed per-head K/V caches
    assert "kv_b_proj_weight" not in text  # the up-projection weight is gone
    assert any(re.fullmatch(r"  # absorb_mla \([\d.]+ ms\): 2 MLA layers absorbed: latent KV 32\+8 per token, "
                            r"dropped 2 up-projection weights", ln) for ln in lines)
    # right after absorb_mla (before TP): every head, full absorbed weights
    stage = dcpgraph.explain(engine, stage="absorb_mla")
    assert re.search(r"= aten\.matmul\(%\w+, %p_model_layers_0_self_attn_kv_b_proj_absorbed_uk\) : \[1, 8, 6, 32\]",
                     stage)
    assert "latent_cache" not in stage
    # the traced program is the decompressed one: kv_b_proj up-projects, canonical attention, no caches
    traced = dcpgraph.explain(zoo.program(name))
    assert "absorbed" not in traced and "latent_cache" not in traced
    assert re.search(r"aten\.linear\(%\w+, %p_model_model_layers_0_self_attn_kv_b_proj_weight\)", traced)
    assert len(re.findall(r"= dcpgraph\.attention\(", traced)) == LAYERS


# -- 5. TP of the DeepSeek layer: routed experts and router replicated -------------------------------
def _router_choices(engine, prompt) -> list[list[torch.Tensor]]:
    """Per rank, the top-k expert indices of every MoE layer for one prefill of ``prompt``: the
    compiled graph with the index tensors that select expert weights added to its outputs, run on
    the emulator (fresh caches)."""
    from dcpgraph.runtime.emulator import run_spmd
    from dcpgraph.runtime.executors import EmulatedExecutor, rank_arguments
    from dcpgraph.runtime.step_inputs import Chunk, build_step_inputs

    program = engine.program
    gm = program.copy_graph()
    graph = gm.graph
    specs = {s.name: s for s in program.inputs}
    experts = {n for n in graph.nodes if n.op == "placeholder" and ".mlp.experts." in specs[n.name].target}
    found: list[torch.fx.Node] = []
    for node in graph.nodes:
        if not (node.op == "call_function" and node.target is aten.index.Tensor and node.args[0] in experts):
            continue
        frontier, seen = [i for i in node.args[1] if i is not None], set()
        while frontier:
            n = frontier.pop()
            if n in seen:
                continue
            seen.add(n)
            if n.op == "call_function" and n.target is operator.getitem and n.args[0].target is aten.topk.default:
                if n not in found:
                    found.append(n)
                continue
            frontier += n.all_input_nodes
    out = next(n for n in graph.nodes if n.op == "output")
    out.args = ((*out.args[0], *found),)
    gm.recompile()
    probe = program.replace(graph_module=gm)
    mesh = program.mesh
    executor = EmulatedExecutor(probe, NUM_BLOCKS)
    blocks = tuple(range(-(-len(prompt) // (BLOCK_SIZE * mesh.dcp))))
    shared, per_rank = build_step_inputs([Chunk(0, tuple(prompt), 0, blocks)], mesh, BLOCK_SIZE, engine.interleave)
    args = [rank_arguments(probe, executor.states[r], executor.caches[r], shared, per_rank[r]) for r in mesh.ranks]
    outputs = run_spmd(gm, args, mesh)
    return [list(o[-len(found):]) for o in outputs]


def _hf_router_choices(model, prompt) -> list[torch.Tensor]:
    """HF's top-k indices per MoE layer (what its experts module receives)."""
    seen = []
    hooks = [layer.mlp.experts.register_forward_pre_hook(lambda _m, args: seen.append(args[1].clone()))
             for layer in model.model.layers if hasattr(layer.mlp, "experts")]
    try:
        with torch.no_grad(), hf_reference(model):
            model(input_ids=torch.tensor([list(prompt)]), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return seen


@pytest.mark.parametrize("name", MODELS)
def test_routed_experts_are_tensor_parallel_and_routing_agrees_on_every_rank(zoo, name):
    # input specs: routed experts tensor-parallel (gate/up packed column-parallel, down row-parallel),
    # the router replicated on every TP rank of every engine
    for case in [c for c in CASES if c[0] == name and c[1] > 1]:
        program = zoo.engine(*case).program
        # the rules shard_tp gave (fuse_linears later stacks sibling projections into one entry)
        rules = {s.target: s.shard.dim for s in program.stage("shard_tp").inputs if s.kind in STATE_KINDS}
        for layer in MOE_LAYERS:
            mlp = f"model.layers.{layer}.mlp"
            assert rules[f"{mlp}.experts.gate_up_proj"] == -2 and rules[f"{mlp}.experts.down_proj"] == -1
            assert rules[f"{mlp}.gate.weight"] is None
            assert (rules[f"{mlp}.shared_experts.gate_proj.weight"], rules[f"{mlp}.shared_experts.up_proj.weight"],
                    rules[f"{mlp}.shared_experts.down_proj.weight"]) == (0, 0, 1)  # TP does shard the MLP
        for layer in range(LAYERS):
            attn = f"model.layers.{layer}.self_attn"
            q = f"{attn}.q_proj.weight" if name == "deepseek_v2" else f"{attn}.q_b_proj.weight"
            assert (rules[q], rules[f"{attn}.o_proj.weight"]) == (0, 1)
            assert rules[f"{attn}.kv_a_proj_with_mqa.weight"] is None  # the latent is every head's
            assert rules[f"{attn}.kv_b_proj.absorbed_uk"] == rules[f"{attn}.kv_b_proj.absorbed_uv_t"] == 0
        tp = program.mesh.tp
        full = [program.state[s.target] for s in program.inputs if s.kind in STATE_KINDS]
        targets = [s.target for s in program.inputs if s.kind in STATE_KINDS]
        for rank in range(tp):
            for target, local, whole in zip(targets, program.local_state(rank), full):
                if target.endswith(".mlp.experts.gate_up_proj"):  # [gate_r; up_r] of every expert
                    gate, up = whole.chunk(2, 1)
                    want = torch.cat([gate.chunk(tp, 1)[rank], up.chunk(tp, 1)[rank]], 1)
                    assert torch.equal(local, want), (rank, target)
                elif target.endswith(".mlp.experts.down_proj"):
                    assert torch.equal(local, whole.chunk(tp, -1)[rank]), (rank, target)
    # the router's choices: identical on every rank, and equal to HF's
    model = zoo.model(name)
    for tp, dcp in ((2, 2), (4, 1)):
        engine = zoo.engine(*case_for(name, tp, dcp))
        for prompt in (PROMPTS[-1], PROMPTS[1]):
            per_rank = _router_choices(engine, prompt)
            hf = _hf_router_choices(model, prompt)
            assert len(hf) == len(MOE_LAYERS) and all(len(c) == len(MOE_LAYERS) for c in per_rank)
            for layer, want in enumerate(hf):
                assert want.shape == (len(prompt), 2)
                for rank, choices in enumerate(per_rank):
                    got = choices[layer].reshape(want.shape)
                    assert torch.equal(got, per_rank[0][layer].reshape(want.shape)), (tp, dcp, rank)
                    assert torch.equal(got.sort(-1).values, want.sort(-1).values), (tp, dcp, rank)
            if len(prompt) > 10:  # routing varies from token to token
                assert len({tuple(x) for x in hf[0].sort(-1).values.tolist()}) >= 3
