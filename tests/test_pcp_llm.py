"""``LLM(..., prefill_context_parallel_size=2)`` on tp·pcp gloo worker processes: greedy tokens
equal HF ``generate`` (fp64, same weights) with chunked prefill, a prefix-cache hit and ngram
speculative decoding, and with MTP speculative decoding; a draft model is checked on the PCP mesh
and what does not run with pcp > 1 in ``LLM`` / ``dcpgraph serve`` is refused by name before any
rank starts (``dcpgraph serve -pcp 2`` itself: tests/test_pcp_pd.py)."""

from __future__ import annotations

import re

import pytest

from dcpgraph import LLM, ConfigError, SamplingParams
from dcpgraph.checkpoints.model_dir import load_model
from dcpgraph.config import DcpgraphConfig
from dcpgraph.serving.llm import checked_checkpoint
from dcpgraph.testing.generation import hf_greedy

NEW = 6
SHARED = [5, 9, 4, 77, 30, 31] * 4  # a prefix of six 4-token blocks that repeats (ngram drafts)
PROMPTS = [SHARED + [11, 12, 13], [5, 9, 4, 77, 30, 31, 32, 33, 34, 35, 36], SHARED + [40, 41]]


def test_pcp_llm_checks_a_draft_model_on_the_tp_pcp_mesh_before_any_rank_starts(checkpoints):
    """The draft directory is inspected on the (tp, pcp, dcp) mesh it runs on: at (1,2,2) a DCP
    group is the two PCP ranks, where the pcp = 1 rule (tp % dcp == 0) would refuse it; a draft
    whose vocabulary differs is still refused by name."""
    path = checkpoints["qwen3"]
    draft = {"method": "draft_model", "num_speculative_tokens": 2, "model": path}
    settings = DcpgraphConfig.from_llm_kwargs(model=path, prefill_context_parallel_size=2,
                                              decode_context_parallel_size=2, speculative_config=draft)
    checked = checked_checkpoint(settings)
    assert checked.config.prefill_context_parallel_size == 2
    assert checked.config.engine_options["speculative_config"] == draft
    other = {**draft, "model": checkpoints["deepseek_v2"]}
    with pytest.raises(ConfigError, match=r"vocabulary 321 differs from the target's 333"):
        LLM(path, prefill_context_parallel_size=2, decode_context_parallel_size=2, speculative_config=other)



def test_serve_with_pcp_refuses_a_pd_consumer_before_any_rank_starts(checkpoints, capsys):
    from dcpgraph.serving.cli import main
    from dcpgraph.testing.pd import kv_config

    for role in ("kv_consumer", "kv_both"):
        code = main([checkpoints["qwen3"], "-pcp", "2", "-dcp", "2", "--kv-transfer-config",
                     kv_config(role, 0, 2, 15000)])
        assert code == 2
        assert re.search(rf"prefill_context_parallel_size=2 .*with P/D kv_role='{role}' .*as kv_producer only",
                         capsys.readouterr().err)


@pytest.mark.gloo
@pytest.mark.slow  # two worker processes each compiling and generating: ~30-60 s on 2 loaded cores
def test_pcp_llm_on_workers_equals_hf_with_chunks_a_prefix_hit_and_ngram_drafts(checkpoints):
    path = checkpoints["qwen3"]
    hf = load_model(path, "float64")
    with LLM(model=path, dtype="float64", block_size=4, prefill_context_parallel_size=2,
             decode_context_parallel_size=2, max_num_batched_tokens=8, enable_prefix_caching=True,
             max_model_len=128, worker_timeout_s=300,
             speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                 "prompt_lookup_max": 3}) as llm:
        assert len(llm.engine.worker_pids()) == 2  # world = tp·pcp = 1·2
        first = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], SamplingParams(temperature=0, max_tokens=NEW))
        again = llm.generate([{"prompt_token_ids": PROMPTS[2]}], SamplingParams(temperature=0, max_tokens=NEW))
        report = llm.engine.report()
        hits, spec = report["prefix_cache"]["hit_tokens"], report["speculative"]
    got = [o.outputs[0].token_ids for o in first + again]
    assert got == [hf_greedy(hf, p, NEW) for p in PROMPTS]
    assert hits >= 16  # the shared prefix's blocks, read from the PCP-written, DCP-sharded cache
    assert spec["drafted"] > spec["accepted"] > 0  # verify steps that kept drafts and ones that dropped some


@pytest.mark.gloo
@pytest.mark.slow  # two workers each tracing and compiling the target and its MTP layer: ~35 s at load 2, ~70 s at 6
def test_pcp_llm_on_workers_with_mtp_drafts_equals_hf(tmp_path):
    """MTP at (1,2,2) on two gloo workers: each rank's proposer reads the target's hidden states
    gathered over the PCP group and runs the split MTP program; drafts kept and dropped (an MTP
    close to, not equal to, the target's next-token function), greedy tokens equal HF's."""
    import torch
    import transformers as tf

    from dcpgraph.testing.checkpoints import make_mtp_predictable, save_tiny_checkpoint

    path = save_tiny_checkpoint(tmp_path / "v3", "deepseek_v3", layers=1, dtype=torch.float64, mtp_weights=True)
    make_mtp_predictable(path, 0.01, hidden_part=0.3, mtp_attention=0.3)
    prompts = PROMPTS[:2]
    with LLM(model=path, dtype="float64", block_size=4, prefill_context_parallel_size=2,
             decode_context_parallel_size=2, max_num_batched_tokens=8, max_model_len=64, enforce_eager=True,
             worker_timeout_s=300, speculative_config={"method": "mtp", "num_speculative_tokens": 2}) as llm:
        assert len(llm.engine.worker_pids()) == 2
        out = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=8))
        spec = llm.engine.report()["speculative"]
    hf = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()  # drops the MTP layer
    assert [o.outputs[0].token_ids for o in out] == [hf_greedy(hf, p, 8) for p in prompts]
    assert spec["method"] == "mtp" and spec["drafted"] > spec["accepted"] > 0, spec
