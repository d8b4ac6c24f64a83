"""The planner's prefill table (``plan(prompt_len=..., pcp_sizes=...)``, ``dcpgraph plan
--prompt-len/--pcp``): every (tp, pcp) layout's TTFT from the PCP roofline, checked against
:func:`~dcpgraph.plan.prefill_cost.prefill_estimate` called by hand and against the zigzag split's
closed form, with the layouts whose weights do not fit flagged and never recommended."""

from __future__ import annotations

import json

import pytest

from dcpgraph.cli import main as dcpgraph_main
from dcpgraph.errors import ConfigError
from dcpgraph.plan import load_model_shape, plan
from dcpgraph.plan.calibration import get_hardware
from dcpgraph.plan.prefill_cost import prefill_estimate

LLAMA70B = dict(world_size=8, hardware="h200", gpu_memory_utilization=0.9, max_model_len=131072)


def _row(p, tp, pcp):
    return next(r for r in p.prefill_rows if r.tp == tp and r.pcp == pcp)


def test_every_layout_of_the_world_is_listed_with_its_replicas():
    p = plan("llama-3.1-70b", prompt_len=32768, **LLAMA70B)
    assert {(r.tp, r.pcp) for r in p.prefill_rows} == {(t, q) for t in (1, 2, 4, 8) for q in (1, 2, 4, 8)
                                                       if 8 % (t * q) == 0}
    assert all(r.replicas * r.tp * r.pcp == 8 for r in p.prefill_rows)


def test_rows_equal_the_estimate_and_pcp_splits_the_prompt():
    p = plan("llama-3.1-70b", prompt_len=32768, **LLAMA70B)
    shape, hw = load_model_shape("llama-3.1-70b"), get_hardware("h200")
    for r in p.prefill_rows:
        assert r.estimate == prefill_estimate(shape, hw, tp=r.tp, pcp=r.pcp, prompt_tokens=32768)
    one, two = _row(p, 4, 1), _row(p, 4, 2)
    assert one.estimate.tokens_per_rank == 32768 and two.estimate.tokens_per_rank == 16384
    assert one.estimate.exchange_s == 0 < two.estimate.exchange_s
    assert two.speedup == pytest.approx(one.estimate.ttft_s / two.estimate.ttft_s)
    assert 1.5 < two.speedup < 2.0  # half the compute, plus the K/V all-gather


def test_layouts_whose_weights_do_not_fit_are_flagged_and_not_recommended():
    p = plan("llama-3.1-70b", prompt_len=32768, **LLAMA70B)
    tp1 = [r for r in p.prefill_rows if r.tp == 1]
    assert tp1 and all(not r.fits and "GiB per rank exceed" in r.rule for r in tp1)
    assert p.prefill_recommended.fits and p.prefill_recommended.tp > 1
    best = min((r for r in p.prefill_rows if r.fits), key=lambda r: r.estimate.ttft_s)
    assert p.prefill_recommended.estimate.ttft_s == best.estimate.ttft_s


def test_a_replica_spanning_nodes_pays_the_inter_node_link():
    two_nodes = plan("llama-3.1-70b", nnodes=2, gpus_per_node=4, hardware="h200", gpu_memory_utilization=0.9,
                     max_model_len=131072, prompt_len=32768, pcp_sizes=(2,))
    one_node = plan("llama-3.1-70b", world_size=8, hardware="h200", gpu_memory_utilization=0.9,
                    max_model_len=131072, prompt_len=32768, pcp_sizes=(2,))
    spanning, local = _row(two_nodes, 4, 2), _row(one_node, 4, 2)
    assert spanning.nodes == 2 and local.nodes == 1
    assert spanning.estimate.exchange_s > local.estimate.exchange_s


def test_pcp_sizes_that_do_not_divide_the_world_are_refused_by_name():
    with pytest.raises(ConfigError, match=r"pcp \[3\] do not divide world_size=8; valid pcp: \[1, 2, 4, 8\]"):
        plan("llama-3.1-70b", pcp_sizes=(3,), **LLAMA70B)


def test_no_prefill_table_unless_asked():
    p = plan("llama-3.1-70b", **LLAMA70B)
    assert p.prefill_rows == [] and p.prompt_len is None


def test_cli_prints_the_prefill_table_and_json(capsys):
    args = ["plan", "llama-3.1-70b", "--world-size", "8", "--gpu-memory-utilization", "0.9",
            "--max-model-len", "131072", "--prompt-len", "32768", "--pcp", "1", "2"]
    assert dcpgraph_main(args) == 0
    out = capsys.readouterr().out
    assert "prefill: time to first token of one 32,768-token prompt" in out and "<- fastest first token" in out
    assert dcpgraph_main(args + ["--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert {(r["tp"], r["pcp"]) for r in d["prefill_rows"]} == {(8, 1), (4, 1), (4, 2), (2, 1), (2, 2), (1, 1),
                                                                 (1, 2)}
    best = d["prefill_rows"][d["prefill_recommended"]]
    assert best["fits"] and best["ttft_ms"] == min(r["ttft_ms"] for r in d["prefill_rows"] if r["fits"])


def test_the_prefill_runs_at_the_measured_rates_of_the_model_dtype():
    """A measured machine's prefill time is its linear FLOPs over the linear rate plus its attention
    FLOPs over the attention rate, both at the model's width; an unmeasured width falls back to
    compute_flops."""
    import dataclasses

    from dcpgraph.plan.calibration import calibrate_prefill
    from dcpgraph.plan.hardware import PRESETS

    cal = calibrate_prefill(linear=(32, 64, 64), attention=(64, 2, 32), reps=1)
    for rates in (cal.linear_flops, cal.attention_flops):
        assert [b for b, _ in rates] == [4, 2] and all(r > 0 for _, r in rates)
    shape = load_model_shape("llama-3.1-70b")
    hw = dataclasses.replace(PRESETS["h200"], linear_flops=((shape.dtype_bytes, 1e9),),
                             prefill_attention_flops=((shape.dtype_bytes, 4e9),))
    est = prefill_estimate(shape, hw, tp=1, pcp=2, prompt_tokens=4096)
    assert est.compute_s == pytest.approx(est.dense_flops / 1e9 + est.attention_flops / 4e9)
    other = dataclasses.replace(hw, linear_flops=((8, 1e9),), prefill_attention_flops=((8, 1e9),))
    assert prefill_estimate(shape, other, tp=1, pcp=2, prompt_tokens=4096).compute_s == pytest.approx(
        (est.dense_flops + est.attention_flops) / hw.compute_flops)
