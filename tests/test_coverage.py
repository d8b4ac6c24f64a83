"""The coverage matrix's fast subset: every row exact or refused by name, none crashing or
mismatching (the whole walk is ``python -m dcpgraph.coverage``, see docs/coverage.md)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from dcpgraph import coverage  # noqa: E402


def test_fast_subset_has_no_crash_and_no_silent_mismatch(tmp_path):
    out = tmp_path / "coverage.md"
    rows = {}
    for arch in coverage.FAST_SUBSET:
        rows[arch] = coverage.check(arch, timeout=600)
    assert all(r.ok for r in rows.values()), {a: r.result for a, r in rows.items()}
    # gemma2: soft-capped, alternating sliding layers with a window (4) shorter than the prompt.
    for arch in ("llama", "qwen2", "qwen3_moe", "gemma2"):
        assert rows[arch].result == "exact" and rows[arch].mesh == "tp1·dcp1, tp4·dcp4", rows[arch]
    assert rows["phi3"].result.startswith("exact at tp1·dcp1; refused: TP plan leaves the K/V projection")
    out.write_text(coverage.to_markdown(list(rows.values())))
    assert "| qwen3_moe | gqa | tp1·dcp1, tp4·dcp4 | exact |" in out.read_text()


def test_a_crash_is_reported_not_raised(monkeypatch):
    def boom(model_type):
        raise KeyError("no such config")

    monkeypatch.setattr(coverage, "tiny_model", boom)
    row = coverage.check("llama", timeout=60)
    assert row.result.startswith("not built: KeyError") and row.ok
