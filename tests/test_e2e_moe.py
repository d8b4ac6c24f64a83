"""End-to-end: MoE decoders (Qwen3-MoE, DeepSeek-V3) against HF ``generate`` in fp64.

Models: ``dcpgraph.models.tiny_config`` (2 layers, 8 query heads, 1 KV head for Qwen3-MoE so every
``(tp, dcp)`` in ``{1,2,4}²`` with ``dcp | tp`` is valid; 4 routed experts, top-2) with a large
``initializer_range`` so greedy outputs vary. dcpgraph gets the model with transformers' default
experts implementation (``grouped_mm``); HF's reference runs ``eager``
(:func:`dcpgraph.testing.generation.hf_reference`: ``grouped_mm`` has no fp64 kernel).

Qwen3-MoE is the family HF passes ``output_router_logits`` to attention for: it must trace
(the keyword is semantics-free) and give HF's tokens at every valid mesh, with both comms.

Routed experts are tensor-parallel by default and partitioned over ranks with
``enable_expert_parallel=True``; both give HF's tokens at every valid mesh with tp > 1, routed-
expert bytes per rank are exactly ``1/tp`` of the model's (counted from each rank's real shards),
and a MoE block with shared experts (DeepSeek-V3) has one TP all-reduce, not two.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import dcpgraph
from dcpgraph import ConfigError, Mesh
from dcpgraph.api import facts_of
from dcpgraph.models import tiny_config
from dcpgraph.passes.collectives import collective_group
from dcpgraph.program import STATE_KINDS
from dcpgraph.testing.generation import drain, hf_greedy

BLOCK_SIZE = 4
MAX_NEW = 12
PROMPTS = ((5,), (9, 4, 77), tuple(range(10, 17)), tuple((7 * i + 3) % 256 for i in range(13)))


def build(arch: str, seed: int = 0) -> torch.nn.Module:
    import transformers as tf

    config = tiny_config(arch)
    config.initializer_range = 0.2
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config).to(torch.float64).eval()
    return model


def valid_meshes(model) -> list[tuple[int, int]]:
    facts = facts_of(model)
    valid = []
    for tp, dcp in itertools.product((1, 2, 4), repeat=2):
        try:
            Mesh(tp, dcp).validate(attention=facts.attention, num_q_heads=facts.num_q_heads,
                                   num_kv_heads=facts.num_kv_heads, block_size=BLOCK_SIZE)
        except ConfigError:
            continue
        valid.append((tp, dcp))
    return valid


class Zoo:
    def __init__(self) -> None:
        self.models, self.programs, self.refs = {}, {}, {}

    def model(self, arch):
        if arch not in self.models:
            self.models[arch] = build(arch)
        return self.models[arch]

    def program(self, arch):
        if arch not in self.programs:
            self.programs[arch] = dcpgraph.trace(self.model(arch))
        return self.programs[arch]

    def references(self, arch):
        if arch not in self.refs:
            self.refs[arch] = {i: hf_greedy(self.model(arch), p, MAX_NEW) for i, p in enumerate(PROMPTS)}
        return self.refs[arch]

    def generate(self, arch, tp, dcp, **kw):
        engine = dcpgraph.compile(self.program(arch), tp=tp, dcp=dcp, block_size=BLOCK_SIZE,
                                  max_num_batched_tokens=8, **kw)
        ids = {engine.add_request(list(p), max_new_tokens=MAX_NEW): i for i, p in enumerate(PROMPTS)}
        return engine, {ids[rid]: toks for rid, toks in drain(engine).items()}


@pytest.fixture(scope="module")
def zoo():
    return Zoo()


QWEN3_MOE_MESHES = [(1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (4, 4)]
SHARDED = [(arch, tp, dcp, ep) for arch in ("qwen3_moe", "deepseek_v3")
           for tp, dcp in QWEN3_MOE_MESHES if tp > 1 for ep in (False, True)]


def test_qwen3_moe_traces_and_references_vary(zoo):
    assert valid_meshes(zoo.model("qwen3_moe")) == QWEN3_MOE_MESHES
    refs = zoo.references("qwen3_moe")
    assert all(len(set(r)) >= 3 for r in refs.values()), refs


# every mesh unfused, and tp2·dcp2 with fuse_linears (off by default): q/k/v one linear a layer
QWEN3_MOE_CASES = [(tp, dcp, False) for tp, dcp in QWEN3_MOE_MESHES] + [(2, 2, True)]


@pytest.mark.parametrize(("tp", "dcp", "fuse"), QWEN3_MOE_CASES,
                         ids=[f"tp{t}-dcp{d}" + ("-fused" if f else "") for t, d, f in QWEN3_MOE_CASES])
def test_qwen3_moe_greedy_matches_hf(zoo, tp, dcp, fuse):
    comm = "a2a" if (tp + dcp) % 2 else "ag_rs"
    engine, got = zoo.generate("qwen3_moe", tp, dcp, comm=comm, interleave=1 if dcp == 1 else 2, fuse_linears=fuse)
    assert got == zoo.references("qwen3_moe")
    summary = next(p.summary for p in engine.program.provenance if p.name == "fuse_linears")
    assert (summary == "disabled") != fuse, summary


def test_deepseek_v3_valid_meshes(zoo):
    assert valid_meshes(zoo.model("deepseek_v3")) == QWEN3_MOE_MESHES


def _expert_bytes(program, rank: int) -> int:
    targets = [s.target for s in program.inputs if s.kind in STATE_KINDS]
    return sum(t.numel() * t.element_size() for name, t in zip(targets, program.local_state(rank))
               if ".mlp.experts." in name)


@pytest.mark.parametrize(("arch", "tp", "dcp", "ep"), SHARDED,
                         ids=[f"{a}-tp{t}-dcp{d}-{'ep' if e else 'tp'}" for a, t, d, e in SHARDED])
def test_sharded_experts_greedy_match_hf_and_hold_one_tp_th(zoo, arch, tp, dcp, ep):
    comm = "a2a" if (tp + dcp + ep) % 2 else "ag_rs"
    engine, got = zoo.generate(arch, tp, dcp, comm=comm, enable_expert_parallel=ep)
    assert got == zoo.references(arch)
    program = engine.program
    full = sum(t.numel() * t.element_size() for n, t in program.state.items() if ".mlp.experts." in n)
    assert full > 0
    assert [_expert_bytes(program, r) * tp for r in range(tp)] == [full] * tp
    report = engine.memory_report()["weight_bytes_per_rank"]
    whole = sum(t.numel() * t.element_size() for s, t in
                ((s, program.state[s.target]) for s in program.inputs if s.kind in STATE_KINDS))
    assert len(report) == tp and all(b < whole for b in report)
    assert report[0] == sum(t.numel() * t.element_size() for t in program.local_state(0))
    assert ("expert_parallel" in program.passes_run()) == ep  # a pipeline pass, chosen by the option
    rules = {s.target: s.shard for s in program.inputs if ".mlp.experts." in s.target}
    assert {r.dim for r in rules.values()} == ({0} if ep else {-2, -1})


def test_one_all_reduce_per_moe_block_with_shared_experts(zoo):
    """DeepSeek-V3 layer 1: routed experts + shared experts are summed before one all-reduce."""
    for ep in (False, True):
        program = zoo.generate("deepseek_v3", 2, 1, enable_expert_parallel=ep)[0].program
        per_layer: dict[str, int] = {}
        for node in program.graph_module.graph.nodes:
            group = collective_group(node)
            if group is None or group[0] != "tp" or "all_reduce" not in str(node.target):
                continue
            stacks = [v[0] for v in (node.args[0].meta.get("nn_module_stack") or {}).values()]
            layer = next((p.split(".")[3] for p in stacks if ".layers." in p), "other")
            per_layer[layer] = per_layer.get(layer, 0) + 1
        # layer 0 dense: o_proj + down_proj; layer 1 MoE: o_proj + one for routed+shared experts
        assert per_layer.get("1") == 2, per_layer


def test_expert_parallel_is_refused_for_a_dense_model(monkeypatch):
    program = dcpgraph.trace(build("qwen3"))
    with pytest.raises(ConfigError, match="enable_expert_parallel=True: .* no expert-parallel plan"):
        dcpgraph.compile(program, tp=2, enable_expert_parallel=True)
    # refused before any tracing
    monkeypatch.setattr(dcpgraph.api, "trace", lambda *a, **k: pytest.fail("traced before refusing"))
    with pytest.raises(ConfigError, match="no expert-parallel plan"):
        dcpgraph.compile(build("qwen3"), tp=2, enable_expert_parallel=True)
