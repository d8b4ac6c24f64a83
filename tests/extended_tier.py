"""The extended tier: the rest of the slow tier's model × mesh matrices.

A matrix test (one test function over many models, meshes or options) keeps its representatives
in the slow tier, which CI runs; every other case of it is marked ``extended`` and runs with
``python -m pytest -m extended`` (or ``python .ci/slow_tier.py --extended``). The representatives
cover every mechanism the matrix checks (each recurrent kind at tp2·dcp2, each merge strategy, interleave 1
and > 1, a tp4 mesh, PCP with DCP); the extended cases repeat those mechanisms on more models and
meshes. A case is a representative when its parametrisation id contains one of the listed
substrings. A listed substring that matches no collected case of its function is an error (a renamed
case must not silently leave CI), except where the command line names cases of that function by id
(``file::function[id]``): then only those cases are collected, and the rest are not missing.
"""
from __future__ import annotations

from collections.abc import Sequence

import pytest

REPRESENTATIVES: dict[str, tuple[str, ...]] = {
    # Bamba (mamba2) and Qwen3-Next (gated delta) run every case; every hybrid runs the draft model
    # at tp2·dcp2, and the KDA, short-conv and lightning ones a prefix hit at tp2·dcp2
    "tests/test_hybrid_acceptance.py::test_speculation_through_chunks_and_a_preemption":
        ("bamba-", "qwen3_next-", "-draft-tp2dcp2"),
    "tests/test_hybrid_acceptance.py::test_prefix_caching_hits_restore_the_state":
        ("bamba-", "qwen3_next-", "kimi_linear-ngram-tp2dcp2", "lfm2-ngram-tp2dcp2", "minimax-ngram-tp2dcp2"),
    # (model-tp-dcp-interleave): tp2·dcp2 at interleave 1 and tp4·dcp2 at interleave 4
    "tests/test_hybrid_mesh.py::test_hybrid_gives_hf_greedy_tokens_on_meshes": ("-2-2-1]", "-4-2-4]"),
    "tests/test_mamba2_mesh.py::test_mamba2_hybrid_gives_hf_greedy_tokens_on_meshes": ("-2-2]",),
    "tests/test_kda_mesh.py::test_kda_hybrid_gives_hf_greedy_tokens_on_meshes": ("-4-2]",),
    # every model at tp4·dcp2 (the mesh test_moe_as_loaded_gives_hf_tokens does not run)
    "tests/test_experts_as_loaded.py::test_moe_as_loaded_gives_hf_tokens_at_every_valid_mesh": ("tp4-dcp2-",),
    # both merges, interleave 1 and 4, with and without MLAPO, V2 and V3
    "tests/test_mlapo.py::test_greedy_matches_hf_with_and_without_mlapo":
        ("v2-tp2-dcp2-il1-a2a", "v3-tp4-dcp2-il4-ag_rs", "v2-tp4-dcp4-il4-ag_rs"),
    "tests/test_e2e_sfa.py::test_greedy_tokens_equal_hf": ("tp2-dcp2-il1-a2a", "tp4-dcp4-il4-ag_rs"),
    # (model-tp-pcp-dcp)
    "tests/test_pcp_compiled.py::test_compiled_pcp_matches_hf_on_every_acceptance_mesh":
        ("llama-2-2-2]", "qwen3-1-4-2]", "qwen3-2-2-1]"),
    "tests/test_pcp_compiled.py::test_compiled_pcp_mla_matches_hf": ("2-2-4]",),
    # prompt length 11 on every mesh
    "tests/test_e2e_compressed.py::test_greedy_matches_hf_generate_more_meshes": ("len11-",),
    "tests/test_e2e_sliding.py::test_tokens_equal_hf": ("tp2dcp2]", "gemma3_text-tp4dcp2]"),
}


def _functions_named_by_case(args: Sequence[str]) -> set[str]:
    """``file::function`` (its last path part) of every command-line argument that names a case id."""
    return {arg.partition("[")[0].replace("\\", "/").rsplit("/", 1)[-1] for arg in args if "::" in arg and "[" in arg}


def mark_extended(items: list[pytest.Item], args: Sequence[str] = ()) -> None:
    """Mark every slow non-representative case of a listed matrix ``extended`` (before ``-m``);
    ``args`` are the command line's test arguments (``config.args``)."""
    named = _functions_named_by_case(args)
    seen: dict[str, set[str]] = {}
    for item in items:
        function, _, params = item.nodeid.partition("[")
        keep = REPRESENTATIVES.get(function)
        if keep is None or not params or item.get_closest_marker("slow") is None:
            continue  # default-tier cases of a matrix stay in the default tier
        case = "[" + params
        hits = {pattern for pattern in keep if pattern in case}
        seen.setdefault(function, set()).update(hits)
        if not hits:
            item.add_marker(pytest.mark.extended)
    for function, hits in seen.items():
        if function.rsplit("/", 1)[-1] in named:
            continue
        stale = [pattern for pattern in REPRESENTATIVES[function] if pattern not in hits]
        if stale:
            raise pytest.UsageError(f"tests/extended_tier.py: {function} has no case matching {stale}")
