"""Speculation through the offline API and the server's metrics, on checkpoints written here.

Reference: HF ``generate`` greedy on the target directory (fp64). The draft is a second
directory of the same tokenizer (a 1-layer model of another seed, or the target itself, which
must then have every draft accepted). The gloo run starts two worker ranks (tp=2, dcp=2), each
loading its shard of the target and of the draft.
"""

from __future__ import annotations

import pytest
import torch

from dcpgraph import LLM, ConfigError, SamplingParams
from dcpgraph.checkpoints.model_dir import load_model
from dcpgraph.serving.metrics import Metrics
from dcpgraph.testing.checkpoints import save_tiny_checkpoint
from dcpgraph.testing.generation import hf_greedy
from dcpgraph.testing.prometheus import samples

PROMPTS = ["héllo wörld", "The future of AI is", "x"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec")
    return {"target": save_tiny_checkpoint(root / "target", "qwen3"),
            "draft": save_tiny_checkpoint(root / "draft", "qwen3", layers=1, seed=1),
            "wide": save_tiny_checkpoint(root / "wide", "qwen3", layers=1, vocab_size=384)}


@pytest.fixture(scope="module")
def reference(dirs):
    model = load_model(dirs["target"], "float64")
    return lambda ids: hf_greedy(model, ids, MAX_TOKENS)


def check_greedy(llm, reference):
    for out in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS)):
        assert out.outputs[0].token_ids == reference(out.prompt_token_ids), out.prompt


@pytest.mark.parametrize("draft", ["draft", "target"])
def test_llm_with_a_draft_directory_equals_hf(dirs, reference, draft):
    config = {"method": "draft_model", "num_speculative_tokens": 3, "model": dirs[draft]}
    with LLM(model=dirs["target"], dtype="float64", block_size=4, speculative_config=config) as llm:
        check_greedy(llm, reference)
        stats = llm.engine.report()["speculative"]
    assert stats["method"] == "draft_model" and stats["drafted"] > 0
    if draft == "target":
        assert stats["accepted"] == stats["drafted"]


def test_llm_refuses_a_draft_of_another_vocabulary(dirs):
    config = {"method": "draft_model", "num_speculative_tokens": 2, "model": dirs["wide"]}
    with pytest.raises(ConfigError, match=r"vocabulary 384 differs from the target's 321"):
        LLM(model=dirs["target"], dtype="float64", speculative_config=config)
    with pytest.raises(ConfigError, match="unknown keys"):
        LLM(model=dirs["target"], speculative_config={"method": "ngram", "num_speculative_tokens": 2, "k": 1})


def test_metrics_render_vllms_spec_decode_counters():
    snapshot = {"running": 0, "waiting": 0, "kv_usage": [0.0], "prefix_cache": {},
                "speculative": {"method": "ngram", "verified_rows": 4, "drafted": 10, "accepted": 6,
                                "accepted_per_position": [3, 2, 1]}}
    text = Metrics("m").render(snapshot)
    assert samples(text, "vllm:spec_decode_num_drafts_total", model_name="m") == [4]
    assert samples(text, "vllm:spec_decode_num_draft_tokens_total", model_name="m") == [10]
    assert samples(text, "vllm:spec_decode_num_accepted_tokens_total", model_name="m") == [6]
    assert samples(text, "vllm:spec_decode_num_accepted_tokens_per_pos_total", model_name="m", position="2") == [1]
    assert "spec_decode" not in Metrics("m").render({**snapshot, "speculative": {}})


@pytest.mark.gloo
@pytest.mark.slow
@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_gloo_workers_tp2_dcp2_speculate(dirs, reference, method):
    config = {"method": method, "num_speculative_tokens": 2}
    if method == "draft_model":
        config["model"] = dirs["target"]
    with LLM(model=dirs["target"], dtype="float64", block_size=4, tensor_parallel_size=2,
             decode_context_parallel_size=2, worker_timeout_s=300, speculative_config=config) as llm:
        check_greedy(llm, reference)
        stats = llm.engine.report()["speculative"]
        assert stats["method"] == method and stats["drafted"] > 0  # verification ran on both ranks
        if method == "draft_model":  # the target as its own draft
            assert stats["drafted"] > 0 and stats["accepted"] == stats["drafted"]
        # sampled: every rank draws the same drafts and acceptances from its own copy of the seeded
        # generator (the driver checks that the ranks' answers agree), so no step count diverges
        sampled = SamplingParams(temperature=0.8, seed=5, max_tokens=MAX_TOKENS)
        first = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sampled)]
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sampled)] == first
        procs = llm.engine.procs
    assert [p.exitcode for p in procs] == [0, 0]


@pytest.mark.slow
def test_serve_with_speculative_config_reports_acceptance(dirs, reference, tmp_path):
    """``dcpgraph serve --speculative-config`` (a draft directory) answers like HF and its
    /metrics counts drafts once the engine loop refreshed its snapshot."""
    import json
    import time

    import httpx

    from dcpgraph.testing.server import running_server

    config = json.dumps({"method": "draft_model", "num_speculative_tokens": 2, "model": dirs["target"]})
    args = ("--dtype", "float64", "--block-size", "4", "--max-model-len", "128", "--speculative-config", config)
    with running_server(dirs["target"], *args, log_path=str(tmp_path / "serve.log")) as server:
        prompt = [72, 105, 33]
        body = {"model": dirs["target"], "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
        reply = httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()
        tokenizer_text = reply["choices"][0]["text"]
        from dcpgraph.checkpoints.model_dir import load_tokenizer

        assert tokenizer_text == load_tokenizer(dirs["target"]).decode(reference(prompt), skip_special_tokens=True)
        deadline, drafted = time.monotonic() + 30, []
        while time.monotonic() < deadline:
            text = httpx.get(server.url + "/metrics", timeout=10).text
            drafted = samples(text, "vllm:spec_decode_num_draft_tokens_total")
            if drafted and float(drafted[0]) > 0:
                break
            time.sleep(0.5)
        accepted = samples(text, "vllm:spec_decode_num_accepted_tokens_total")
        assert drafted and float(drafted[0]) > 0 and accepted == drafted  # the target as draft: all accepted


def test_mtp_is_refused_with_the_reason(tmp_path):
    """A config without MTP layers, a DeepSeek-V3 checkpoint whose files lack the MTP weights, and
    one that holds only part of them: each refused, naming why, before any work; with all of them
    MTP runs (greedy tokens as without speculation)."""
    from safetensors.torch import load_file, save_file

    mtp = {"method": "mtp", "num_speculative_tokens": 1}
    qwen = save_tiny_checkpoint(tmp_path / "qwen3", "qwen3")
    with pytest.raises(ConfigError, match=r"needs a checkpoint with multi-token-prediction layers"):
        LLM(model=qwen, speculative_config=mtp)
    v3 = save_tiny_checkpoint(tmp_path / "v3", "deepseek_v3")
    with pytest.raises(ConfigError, match=r"num_nextn_predict_layers=1 but holds MTP weights for 0 layer"):
        LLM(model=v3, speculative_config=mtp)
    weights = load_file(f"{v3}/model.safetensors")
    hidden = weights["model.embed_tokens.weight"].shape[1]
    weights["model.layers.2.eh_proj.weight"] = torch.zeros(hidden, 2 * hidden)
    save_file(weights, f"{v3}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=r"MTP layer 2 has no checkpoint tensor for \['model.layers.2.self_attn"):
        LLM(model=v3, speculative_config=mtp)
    full = save_tiny_checkpoint(tmp_path / "v3mtp", "deepseek_v3", mtp_weights=True)
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}
    greedy = SamplingParams(temperature=0, max_tokens=6)
    plain = LLM(model=full).generate([prompt], greedy)[0].outputs[0].token_ids
    llm = LLM(model=full, speculative_config=mtp)
    assert llm.generate([prompt], greedy)[0].outputs[0].token_ids == plain
    assert llm.engine.report()["speculative"]["drafted"] > 0
