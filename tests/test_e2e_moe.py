"""End-to-end: MoE decoders (Qwen3-MoE, DeepSeek-V3) against HF ``generate`` in fp64.

Models: ``dcpgraph.models.tiny_config`` (2 layers, 8 query heads, 1 KV head for Qwen3-MoE so every
``(tp, dcp)`` in ``{1,2,4}²`` with ``dcp | tp`` is valid; 4 routed experts, top-2) with a large
``initializer_range`` so greedy outputs vary. HF runs with ``set_experts_implementation("eager")``
(``grouped_mm`` has no fp64 kernel); dcpgraph traces the same weights.

Qwen3-MoE is the family HF passes ``output_router_logits`` to attention for: it must trace
(the keyword is semantics-free) and give HF's tokens at every valid mesh, with both comms.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import dcpgraph
from dcpgraph import ConfigError, Mesh
from dcpgraph.api import facts_of
from dcpgraph.models import tiny_config
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
    model.set_experts_implementation("eager")
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
                                  max_batched_tokens=8, **kw)
        ids = {engine.add_request(list(p), max_new_tokens=MAX_NEW): i for i, p in enumerate(PROMPTS)}
        return engine, {ids[rid]: toks for rid, toks in drain(engine).items()}


@pytest.fixture(scope="module")
def zoo():
    return Zoo()


QWEN3_MOE_MESHES = [(1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (4, 4)]


def test_qwen3_moe_traces_and_references_vary(zoo):
    assert valid_meshes(zoo.model("qwen3_moe")) == QWEN3_MOE_MESHES
    refs = zoo.references("qwen3_moe")
    assert all(len(set(r)) >= 3 for r in refs.values()), refs


@pytest.mark.parametrize(("tp", "dcp"), QWEN3_MOE_MESHES, ids=[f"tp{t}-dcp{d}" for t, d in QWEN3_MOE_MESHES])
def test_qwen3_moe_greedy_matches_hf(zoo, tp, dcp):
    comm = "a2a" if (tp + dcp) % 2 else "ag_rs"
    _, got = zoo.generate("qwen3_moe", tp, dcp, comm=comm, interleave=1 if dcp == 1 else 2)
    assert got == zoo.references("qwen3_moe")
