"""``speculative_config`` (vLLM's shape) is checked before any work, with the reason."""

from __future__ import annotations

import pytest
import torch

import dcpgraph
from dcpgraph.errors import ConfigError
from dcpgraph.models import build_model
from dcpgraph.options import compile_options
from dcpgraph.runtime.speculative_config import SpeculativeConfig, speculative_config
from dcpgraph.serving.cli import build_parser, llm_options


@pytest.mark.parametrize("config, message", [
    ({"method": "medusa", "num_speculative_tokens": 2}, r"method'\] must be one of \['ngram', 'draft_model', 'mtp'\]"),
    ({"num_speculative_tokens": 2}, r"must be one of"),
    ({"method": "ngram"}, r"needs 'num_speculative_tokens'"),
    ({"method": "ngram", "num_speculative_tokens": 0}, r"num_speculative_tokens'\] must be an int >= 1, got 0"),
    ({"method": "ngram", "num_speculative_tokens": "3"}, r"must be an int >= 1, got '3'"),
    ({"method": "ngram", "num_speculative_tokens": True}, r"must be an int >= 1"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_tp": 1}, r"unknown keys \['draft_tp'\]; valid keys"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     r"prompt_lookup_min \(4\) > prompt_lookup_max \(2\)"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "/x"}, r"takes no 'model'"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, r"needs 'model'"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": "/no/such/dir"}, r"not a local HF model"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": 3}, r"must be a model directory"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": "/x", "prompt_lookup_max": 2},
     r"apply to method 'ngram' only"),
    ({"method": "mtp", "num_speculative_tokens": 1, "model": "/x"}, r"'mtp' uses the target checkpoint's own"),
    ("ngram", r"must be a dict"),
])
def test_bad_configs_are_refused_with_the_reason(config, message):
    with pytest.raises(ConfigError, match=message):
        speculative_config(config)
    with pytest.raises(ConfigError, match=message):  # the same check runs in compile's option check
        compile_options(speculative_config=config)


def test_good_configs_and_the_older_speculative_tokens():
    assert speculative_config(None) is None
    assert speculative_config({"method": "ngram", "num_speculative_tokens": 4}) == SpeculativeConfig("ngram", 4, None, 1, 3)
    assert speculative_config({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5}) == \
        SpeculativeConfig("ngram", 2, None, 5, 5)
    assert speculative_config(None, 3) == SpeculativeConfig("ngram", 3)  # speculative_tokens=k still works
    with pytest.raises(ConfigError, match="not both"), pytest.warns(DeprecationWarning, match="speculative_tokens"):
        compile_options(speculative_config={"method": "ngram", "num_speculative_tokens": 2}, speculative_tokens=2)
    assert compile_options()["speculative_config"] is None


def test_model_dependent_refusals_come_before_any_pass():
    target = build_model("llama")
    wrong_vocab = build_model("qwen3")
    wrong_vocab.resize_token_embeddings(300)
    with pytest.raises(ConfigError, match=r"vocabulary \(300\) differs from the target's \(256\)"):
        dcpgraph.compile(target, speculative_config={"method": "draft_model", "num_speculative_tokens": 2,
                                                      "model": wrong_vocab})
    with pytest.raises(ConfigError, match=r"'mtp' needs a checkpoint with multi-token-prediction layers"):
        dcpgraph.compile(target, speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    # a draft whose heads the mesh cannot split is refused naming the draft
    odd = build_model("llama", layers=1)
    odd.config.num_attention_heads = 3
    with pytest.raises(ConfigError, match="the draft model does not fit the mesh"):
        from dcpgraph.api import facts_of
        from dcpgraph.mesh import Mesh
        from dcpgraph.speculative.draft_model import check_draft

        check_draft(facts_of(target), facts_of(odd), Mesh(4, 2), block_size=4, interleave=1, max_model_len=64)


def test_serve_flag_parses_vllm_json():
    args = build_parser().parse_args(["/m", "--speculative-config",
                                      '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'])
    assert llm_options(args)["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 3,
                                                       "prompt_lookup_max": 4}
    assert "speculative_config" not in llm_options(build_parser().parse_args(["/m"]))
    for bad in ("{method: ngram}", "[1, 2]"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["/m", "--speculative-config", bad])


def test_deepseek_v3_config_reports_its_mtp_layers():
    from dcpgraph.api import facts_of

    model = build_model("deepseek_v3", dtype=torch.float32)
    assert facts_of(model).extra["num_nextn_predict_layers"] == model.config.num_nextn_predict_layers
