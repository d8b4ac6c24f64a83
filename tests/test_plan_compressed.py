"""The planner on DeepSeek-V4 (``dcpgraph plan`` with a ``deepseek_v4`` config).

Independent checks: every figure of a plan row equals :func:`compressed_cache_bytes` called here by
hand on the HF config (the planner keeps no second copy of the formula); the per-token figure of
the named V4-Flash shape is the HF config's own arithmetic written out here; the weight count is
the parameters of HF's model built from the same config (the tiny seeded one, and V4-Flash's
shapes on the meta device with fewer layers); the longest request is checked against the
formula at its edge.
"""

from __future__ import annotations

import json
from fractions import Fraction

import dsv4_models
import pytest
import torch
import transformers

from dcpgraph.cli import main as dcpgraph_main
from dcpgraph.errors import ConfigError, UnsupportedModelError
from dcpgraph.plan import load_model_shape, plan
from dcpgraph.plan.architectures import ARCHITECTURES
from dcpgraph.plan.compressed_cache import compressed_cache_bytes

BUDGET = 1 << 20  # bytes per rank: a few requests of the tiny model's contexts


def _tiny_plan(**kw):
    args = dict(world_size=4, hardware="h200", kv_cache_memory_bytes=BUDGET, max_model_len=2048,
                context_len=1024, block_size=4)
    args.update(kw)
    return plan(dsv4_models.config(), **args)


def test_rows_equal_the_formula_called_by_hand():
    cfg = dsv4_models.config()
    p = _tiny_plan()
    rows = [r for r in p.rows if r.fits]
    assert {(r.tp, r.dcp) for r in rows} == {(1, 1), (2, 1), (2, 2)}  # o_groups=2: tp=4 is refused
    for r in rows:
        by_hand = compressed_cache_bytes(cfg, context_tokens=1024, dcp=r.dcp, interleave=r.interleave,
                                         element_bytes=2)  # a config without a dtype: bf16
        assert r.request_bytes == by_hand.total
        assert r.kv_bytes_per_token == float(by_hand.per_token)
        assert r.max_concurrency == BUDGET // by_hand.total
        longest = r.capacity_tokens
        at = compressed_cache_bytes(cfg, context_tokens=longest, dcp=r.dcp, interleave=r.interleave, element_bytes=2)
        past = compressed_cache_bytes(cfg, context_tokens=longest + 1, dcp=r.dcp, interleave=r.interleave,
                                      element_bytes=2)
        assert at.total <= BUDGET < past.total or longest == 2048 and at.total <= BUDGET


def test_per_token_falls_by_dcp_and_capacity_grows():
    p = _tiny_plan()
    one = next(r for r in p.rows if r.tp == 2 and r.dcp == 1)
    two = next(r for r in p.rows if r.tp == 2 and r.dcp == 2 and r.interleave == 1 and r.comm == "a2a")
    assert two.kv_bytes_per_token == one.kv_bytes_per_token / 2
    assert two.max_concurrency > 1.8 * one.max_concurrency  # ~2x: the open windows stay replicated


def test_o_groups_must_divide_tp():
    p = _tiny_plan()
    row = next(r for r in p.rows if r.tp == 4)
    assert not row.valid and "o_groups=2 is not divisible by tp=4; valid tp: [1, 2]" in row.rule


def test_flash_per_token_bytes_are_the_hf_config_arithmetic():
    cfg = transformers.DeepseekV4Config()  # its docstring's checkpoint: DeepSeek-V4-Flash-Base
    flash = ARCHITECTURES["deepseek-v4-flash"]
    assert all(getattr(cfg, k) == v for k, v in flash.items() if k not in ("name", "torch_dtype"))
    shape = load_model_shape("deepseek-v4-flash")
    assert shape.layer_types == tuple(cfg.layer_types)
    csa = cfg.layer_types.count("compressed_sparse_attention")
    hca = cfg.layer_types.count("heavily_compressed_attention")
    assert (csa, hca) == (20, 23)
    per_token_bf16 = Fraction(csa * (512 + 128) * 2, 4) + Fraction(hca * 512 * 2, 128)  # = 6,584
    p = plan("deepseek-v4-flash", world_size=8, hardware="h200", gpu_memory_utilization=0.9,
             max_model_len=1 << 20, context_len=1 << 17, weight_dtype_bytes=1)
    for dcp in (1, 2, 4, 8):
        row = next(r for r in p.rows if r.tp == 8 and r.dcp == dcp and r.interleave == 1)
        assert row.kv_bytes_per_token == per_token_bf16 / dcp
        by_hand = compressed_cache_bytes(cfg, context_tokens=1 << 17, dcp=dcp, element_bytes=2)
        assert row.request_bytes == by_hand.total
        assert row.max_concurrency == row.kv_budget_bytes_per_rank // by_hand.total
    assert p.recommended.dcp > 1  # at 128k tokens the entries dominate: DCP multiplies concurrency


def _meta_params(config) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters())


def test_weight_params_equal_the_hf_model():
    tiny = dsv4_models.config()  # every layer kind, both routers, hc_mult 2
    assert load_model_shape(tiny).weight_params_per_rank(1) == _meta_params(tiny)
    # V4-Flash's layer shapes, four layers (HCA, HCA, HCA, CSA) and eight experts to stay small
    flash = dict(ARCHITECTURES["deepseek-v4-flash"], num_hidden_layers=4, n_routed_experts=8)
    assert load_model_shape(flash).weight_params_per_rank(1) == _meta_params(transformers.DeepseekV4Config(**flash))
    assert round(load_model_shape("deepseek-v4-flash").weight_params_per_rank(1) / 1e9) == 284  # published
    tp8 = load_model_shape("deepseek-v4-flash").weight_params_per_rank(8)
    assert tp8 < load_model_shape("deepseek-v4-flash").weight_params_per_rank(1) / 7


def test_refusals_name_what_is_missing():
    with pytest.raises(ConfigError, match="fp8_e4m3 cache is not modelled for DeepSeek-V4"):
        _tiny_plan(kv_cache_dtype="fp8_e4m3")
    with pytest.raises(UnsupportedModelError, match="compressed_cache_bytes"):
        load_model_shape(dsv4_models.config()).cache_shapes(1)


def test_cli_table_and_json(capsys):
    argv = ["plan", "deepseek-v4-flash", "--world-size", "8", "--hardware", "h200", "--gpu-memory-utilization",
            "0.9", "--max-model-len", "1048576", "--context-len", "131072", "--weight-dtype-bytes", "1"]
    assert dcpgraph_main(argv) == 0
    out = capsys.readouterr().out
    assert "model deepseek-v4-flash: COMPRESSED, 43 layers" in out
    assert "6,584" in out and "823" in out  # B/token/rank at dcp=1 and dcp=8
    assert ("one 131,072-token request per rank at dcp=1 interleave=1: 834.5 MiB = window 5.3 + entries 663.0 "
            "+ indexer keys 160.0 + open windows 6.2 MiB") in out
    assert dcpgraph_main(argv + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    rows = {r["dcp"]: r for r in data["rows"] if r["tp"] == 8 and r["valid"] and r["interleave"] == 1}
    assert rows[8]["max_concurrency"] >= 7 * rows[1]["max_concurrency"]
