"""MoE models handed to dcpgraph exactly as transformers gives them.

``AutoModelForCausalLM.from_config`` / ``from_pretrained`` give a model in fp32 with the ``sdpa``
attention and the ``grouped_mm`` experts implementation (transformers 5.2x): that is what every
test here compiles, never a model a test switched to ``eager`` first. The reference is HF's own
``generate`` on an fp64 deep copy with transformers' ``eager`` experts
(:func:`dcpgraph.testing.generation.hf_reference`), so dcpgraph (fp32, traced ``batched_mm``) and
HF share the weights and nothing else.

Also here: every experts implementation a user can load with (``eager``, ``grouped_mm``,
``batched_mm``, a kernel registered under its own name as the hub kernels are) traces to one
output and leaves the user's model as it was; a load-time weight layout (``deepgemm_megamoe``) is
refused by name; and no test outside the reference helper and the tests of implementations sets
an experts implementation (the suite would otherwise hide what users hit first).
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch

import dcpgraph
from dcpgraph.errors import UnsupportedModelError
from dcpgraph.models import tiny_config
from dcpgraph.runtime.distributed import spawn
from dcpgraph.testing.generation import hf_greedy

PROMPTS = ((5,), (9, 4, 77), tuple(range(10, 17)))
MAX_NEW = 8
ARCHS = ("deepseek_v2", "deepseek_v3", "qwen3_moe")
# (tp, dcp) at tp 2 and 4 with dcp 1, 2 and 4 all covered, every architecture at tp 2 and tp 4.
MESHES = {"deepseek_v2": [(2, 2), (4, 1)], "deepseek_v3": [(2, 1), (4, 4)], "qwen3_moe": [(2, 2), (4, 2)]}
ALL_MESHES = [(2, 1), (2, 2), (4, 1), (4, 2), (4, 4)]  # every valid one: 1 KV head / MLA


def as_loaded(arch: str, seed: int = 0) -> torch.nn.Module:
    """A tiny ``arch`` model built the way a user gets one: ``from_config`` and nothing else."""
    import transformers as tf

    config = tiny_config(arch)
    config.initializer_range = 0.2  # varied greedy outputs
    torch.manual_seed(seed)
    return tf.AutoModelForCausalLM.from_config(config).eval()


def reference(model: torch.nn.Module) -> list[list[int]]:
    """HF ``generate`` on an fp64 copy of ``model`` (the model itself is not touched)."""
    twin = copy.deepcopy(model).to(torch.float64)
    return [hf_greedy(twin, p, MAX_NEW) for p in PROMPTS]


_CACHE: dict[str, tuple[torch.nn.Module, list[list[int]]]] = {}


def model_and_reference(arch: str):
    if arch not in _CACHE:
        model = as_loaded(arch)
        _CACHE[arch] = (model, reference(model))
    return _CACHE[arch]


def test_the_models_carry_transformers_defaults():
    for arch in ARCHS:
        model, refs = model_and_reference(arch)
        assert model.config._experts_implementation == "grouped_mm", arch
        assert model.config._attn_implementation == "sdpa", arch
        assert next(model.parameters()).dtype == torch.float32, arch
        assert any(len(set(r)) >= 3 for r in refs), (arch, refs)  # the comparison can fail


@pytest.mark.parametrize(("arch", "tp", "dcp"), [(a, t, d) for a, ms in MESHES.items() for t, d in ms],
                         ids=[f"{a}-tp{t}-dcp{d}" for a, ms in MESHES.items() for t, d in ms])
def test_moe_as_loaded_gives_hf_tokens(arch, tp, dcp):
    model, refs = model_and_reference(arch)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    engine = dcpgraph.compile(model, tp=tp, dcp=dcp, block_size=4, max_num_batched_tokens=8)
    assert engine.generate([list(p) for p in PROMPTS], MAX_NEW) == refs
    assert model.config._experts_implementation == "grouped_mm"  # the user's model is unchanged
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(("tp", "dcp"), ALL_MESHES, ids=[f"tp{t}-dcp{d}" for t, d in ALL_MESHES])
def test_moe_as_loaded_gives_hf_tokens_at_every_valid_mesh(arch, tp, dcp):
    model, refs = model_and_reference(arch)
    engine = dcpgraph.compile(model, tp=tp, dcp=dcp, block_size=4, max_num_batched_tokens=8,
                              comm="a2a" if dcp % 2 else "ag_rs")
    assert engine.generate([list(p) for p in PROMPTS], MAX_NEW) == refs


def _gloo_rank(rank: int, world: int, arch: str, dcp: int):
    model = as_loaded(arch)
    engine = dcpgraph.compile(model, tp=world, dcp=dcp, block_size=4, max_num_batched_tokens=8)
    return engine.report()["executor"], engine.generate([list(p) for p in PROMPTS], MAX_NEW)


@pytest.mark.slow
@pytest.mark.gloo
@pytest.mark.parametrize("arch", ARCHS)
def test_moe_as_loaded_on_gloo_ranks_gives_hf_tokens(arch):
    results = spawn(_gloo_rank, 2, arch, 2, timeout_s=300)
    _, refs = model_and_reference(arch)
    assert [r[0] for r in results] == ["distributed", "distributed"]
    assert all(r[1] == refs for r in results)


# -- every experts implementation ------------------------------------------------------------------
def _registered_kernel(self, hidden_states, top_k_index, top_k_weights):
    """Stands in for a hub kernel: an implementation transformers dispatches to by a name of its own."""
    from transformers.integrations.moe import grouped_mm_experts_forward

    return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)


@pytest.mark.parametrize("implementation", ["eager", "grouped_mm", "batched_mm", "registered-kernel"])
def test_every_experts_implementation_traces_and_is_restored(implementation):
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if implementation == "registered-kernel":
        ALL_EXPERTS_FUNCTIONS.register(implementation, _registered_kernel)
    model, refs = model_and_reference("qwen3_moe")
    model = copy.deepcopy(model)
    model.set_experts_implementation(implementation)
    engine = dcpgraph.compile(model, tp=2, dcp=1, block_size=4, max_num_batched_tokens=8)
    assert engine.generate([list(p) for p in PROMPTS], MAX_NEW) == refs
    assert model.config._experts_implementation == implementation
    assert {m.config._experts_implementation for m in model.modules() if hasattr(m, "config")} == {implementation}


def test_a_load_time_expert_layout_is_refused_by_name():
    model = copy.deepcopy(model_and_reference("qwen3_moe")[0])
    model.config._experts_implementation_internal = "deepgemm_megamoe"  # set at load time on GPUs
    with pytest.raises(UnsupportedModelError, match="deepgemm_megamoe.*load time"):
        dcpgraph.trace(model)
    assert model.config._experts_implementation == "deepgemm_megamoe"


# -- the suite itself ------------------------------------------------------------------------------
# Files that may set an experts implementation: the reference helper, and tests of implementations.
EXPERTS_SETTERS_ALLOWED = {
    "dcpgraph/testing/generation.py": "hf_reference: HF's fp64 reference runs eager and is restored",
    "tests/test_experts_as_loaded.py": "tests every implementation users can load with",
    "tests/test_loader.py": "tests that traceable_experts restores the model's own setting",
    "tests/dsv4_models.py": "the DeepSeek-V4 reference ops run inside HF's own modules, experts included, on "
                            "both sides of the comparison (fp64: grouped_mm has none); dcpgraph compiles no V4 experts",
}
SETTER = re.compile(r"set_experts_implementation\(|experts_implementation\s*=|_experts_implementation_internal\s*=")


def experts_setters(root: Path) -> list[str]:
    """``path:line`` of every place under ``root``'s tests and ``dcpgraph/testing`` that sets an
    experts implementation, outside :data:`EXPERTS_SETTERS_ALLOWED`."""
    found = []
    for folder in ("tests", "dcpgraph/testing"):
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if rel in EXPERTS_SETTERS_ALLOWED:
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if SETTER.search(line.split("#", 1)[0]):
                    found.append(f"{rel}:{number}")
    return found


def test_no_test_sets_an_experts_implementation_it_does_not_test(tmp_path):
    root = Path(__file__).resolve().parent.parent
    assert experts_setters(root) == []
    # the scan finds what it is meant to find
    (tmp_path / "tests").mkdir()
    (tmp_path / "dcpgraph" / "testing").mkdir(parents=True)
    (tmp_path / "tests" / "test_x.py").write_text('m = 1\nmodel.set_experts_implementation("eager")\n')
    assert experts_setters(tmp_path) == ["tests/test_x.py:2"]


# -- a plan that leaves the routed experts out ------------------------------------------------------
@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_experts_the_plan_leaves_out_get_the_plans_own_styles(arch):
    """transformers 5.25 dropped the experts' entries from these configs' ``base_model_tp_plan``;
    the front end supplies exactly what 5.24's plans say, and adds nothing where a plan has them."""
    from dcpgraph.frontends.hf import tensor_parallel_experts, tp_plan

    model = model_and_reference(arch)[0] if arch in _CACHE else as_loaded(arch)
    full = tp_plan(model)
    routed = {k: v for k, v in full.items() if ".mlp.experts" in k}
    assert routed == {"model.layers.*.mlp.experts.gate_up_proj": "packed_colwise",
                      "model.layers.*.mlp.experts.down_proj": "rowwise",
                      "model.layers.*.mlp.experts": "moe_tp_experts"}
    without = {k: v for k, v in full.items() if k not in routed}
    assert tensor_parallel_experts(model, without) == routed
    assert tensor_parallel_experts(model, full) == {}
