"""The coverage matrix's fast subset: every row exact or refused by name, none crashing or
mismatching (the whole walk is ``python -m dcpgraph.coverage``, see docs/coverage.md)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from dcpgraph import coverage  # noqa: E402


@pytest.mark.slow  # ~10-20 s: kept out of the default tier's time budget
def test_fast_subset_has_no_crash_and_no_silent_mismatch(tmp_path):
    out = tmp_path / "coverage.md"
    rows = {}
    for arch in coverage.FAST_SUBSET:
        rows[arch] = coverage.check(arch, timeout=600)
    assert all(r.ok for r in rows.values()), {a: r.result for a, r in rows.items()}
    # gemma2: soft-capped, alternating sliding layers with a window (4) shorter than the prompt.
    for arch in ("llama", "qwen2", "qwen3_moe", "gemma2"):
        assert rows[arch].result == "exact" and rows[arch].mesh == "tp1·dcp1, tp4·dcp4", rows[arch]
    assert rows["phi3"].result == "exact", rows["phi3"]  # fused [q; k; v] split by head
    out.write_text(coverage.to_markdown(list(rows.values())))
    assert "| qwen3_moe | gqa | tp1·dcp1, tp4·dcp4 | exact |" in out.read_text()


@pytest.mark.parametrize("arch, reason", [
    ("mamba", "recurrent layers (Mamba/SSM"),
    ("zaya", "hybrid Mamba/SSM + attention layers"),
    ("rwkv", "not an attention model"),
    ("bart", "encoder-decoder"),
    ("gemma3", "composite model"),
    ("lfm3", "no attention layer was recognised in the traced graph"),  # before any pass, not a PassOrderError
])
def test_unsupported_kinds_are_refused_by_name_before_anything_runs(arch, reason):
    row = coverage.check(arch, timeout=300)
    assert row.result.startswith("refused: ") and reason in row.result, row


def test_multi_head_models_are_checked_under_tp_when_no_dcp_mesh_is_valid():
    # gpt_neox: 8 query = 8 KV heads, so tp > KV heads (DCP's rule) is impossible at <= 4 ranks.
    row = coverage.check("gpt_neox", timeout=600)
    assert row.mesh == "tp1·dcp1, tp4·dcp1", row
    assert row.result.startswith("exact without DCP: no DCP mesh of at most 4 ranks is valid"), row


def test_layers_without_attention_are_refused():
    from dcpgraph.errors import UnsupportedModelError
    from dcpgraph.frontends.layer_kinds import check_layer_types, require_attention_in_every_layer

    require_attention_in_every_layer(3, [0, 1, 2], "M")
    require_attention_in_every_layer(2, [None, None], "M")
    with pytest.raises(UnsupportedModelError, match=r"1 of 3 decoder layers have no attention .*\(layers \[1\]\)"):
        require_attention_in_every_layer(3, [0, 2], "M")
    with pytest.raises(UnsupportedModelError, match="2 of 2 decoder layers"):
        require_attention_in_every_layer(2, [], "M")

    class Config:
        layer_types = ["full_attention", "sliding_attention", "conv"]

    with pytest.raises(UnsupportedModelError, match=r"short-convolution layers .*'conv' at layers \[2\]"):
        check_layer_types(Config)
    Config.layer_types = ["full_attention", "sliding_attention"]
    check_layer_types(Config)
    Config.attention_chunk_size = 8
    with pytest.raises(UnsupportedModelError, match="chunked"):
        check_layer_types(Config)


def test_a_crash_is_reported_not_raised(monkeypatch):
    def boom(model_type):
        raise KeyError("no such config")

    monkeypatch.setattr(coverage, "tiny_model", boom)
    row = coverage.check("llama", timeout=60)
    assert row.result.startswith("not built: KeyError") and row.ok


def test_export_constraint_on_the_token_count_is_a_named_refusal():
    import torch

    from dcpgraph.frontends.export import TokenShapeRefusal, run_export

    class FixedBlocks(torch.nn.Module):
        def forward(self, input_ids, position_ids):
            return input_ids.reshape(-1, 4).sum(-1) + position_ids.reshape(-1, 4).sum(-1)  # T % 4 == 0

    tokens = torch.export.Dim("tokens", min=2, max=64)
    example = (torch.zeros(1, 8, dtype=torch.int64), torch.arange(8).unsqueeze(0))
    with pytest.raises(TokenShapeRefusal, match="data-dependent token shapes in export"):
        run_export(FixedBlocks(), example, {"input_ids": {1: tokens}, "position_ids": {1: tokens}})


def test_update_reruns_rows_in_place(tmp_path, monkeypatch):
    out = tmp_path / "coverage.md"
    rows = [coverage.Row("llama", "gqa", "tp1·dcp1, tp4·dcp4", "exact"),
            coverage.Row("gpt2", "gqa", "tp1·dcp1", "error: RuntimeError: index_copy_(): a | b"),
            coverage.Row("bart", "?", "", "refused: encoder-decoder, not a decoder-only causal LM")]
    out.write_text(coverage.to_markdown(rows, "python -m dcpgraph.coverage --timeout 9"))
    command, updates, parsed = coverage.from_markdown(out.read_text())
    assert command == "python -m dcpgraph.coverage --timeout 9" and updates == ()
    assert [(r.architecture, r.attention, r.mesh, r.result) for r in parsed] == \
        [(r.architecture, r.attention, r.mesh, r.result) for r in rows]
    rerun = []
    monkeypatch.setattr(coverage, "check", lambda arch, timeout: rerun.append(arch) or coverage.Row(arch, "gqa", "tp1·dcp1", "refused: x"))
    assert coverage.main(["--update", "--out", str(out)]) == 0
    assert rerun == ["gpt2"]  # only the crash
    command, updates, parsed = coverage.from_markdown(out.read_text())
    assert command == "python -m dcpgraph.coverage --timeout 9" and len(updates) == 1
    assert [r.result for r in parsed] == ["exact", "refused: x", rows[2].result]


def test_a_value_read_back_from_a_tensor_is_refused_by_name():
    import torch

    from dcpgraph.errors import UnsupportedModelError
    from dcpgraph.frontends.export import _refuse_tensor_readback, run_export

    class ReadBack(torch.nn.Module):
        def forward(self, input_ids, position_ids):
            return input_ids * input_ids.max().item() + position_ids

    tokens = torch.export.Dim("tokens", min=2, max=64)
    example = (torch.ones(1, 8, dtype=torch.int64), torch.arange(8).unsqueeze(0))
    exported, _ = run_export(ReadBack(), example, {"input_ids": {1: tokens}, "position_ids": {1: tokens}})
    with pytest.raises(UnsupportedModelError, match=r"data-dependent values \(a tensor read back"):
        _refuse_tensor_readback(exported.graph_module.graph)
