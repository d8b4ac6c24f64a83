"""Sampling defaults from ``generation_config.json`` (vLLM's ``--generation-config auto``): a
request that omits a field samples with the checkpoint's value, an explicit one wins; the server
logs each request's effective SamplingParams (debug), which is what these tests read."""

from __future__ import annotations

import json
import os
import re

import httpx
import pytest

from dcpgraph.serving.generation_defaults import generation_defaults, with_defaults
from dcpgraph.serving.params import SamplingParams
from dcpgraph.testing.checkpoints import save_tiny_checkpoint

GENERATION = {"temperature": 0.25, "top_k": 7, "top_p": 0.9, "repetition_penalty": 1.1, "min_p": 0.05,
              "eos_token_id": 258}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = save_tiny_checkpoint(tmp_path_factory.mktemp("genconfig") / "m", "qwen3", layers=1)
    with open(os.path.join(path, "generation_config.json")) as f:
        config = json.load(f)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({**config, **GENERATION}, f)
    return path


def test_defaults_are_the_files_sampling_fields_and_a_given_value_wins(model_dir, tmp_path):
    defaults = generation_defaults(model_dir)
    assert defaults == {"temperature": 0.25, "top_k": 7, "top_p": 0.9, "repetition_penalty": 1.1, "min_p": 0.05}
    params = with_defaults(SamplingParams(temperature=0.8, top_k=0), {"temperature"}, defaults)
    assert (params.temperature, params.top_k, params.top_p, params.repetition_penalty, params.min_p) == \
        (0.8, 7, 0.9, 1.1, 0.05)
    assert generation_defaults(model_dir, "vllm") == {}
    assert generation_defaults(str(tmp_path)) == {}  # a directory without the file: vLLM's defaults
    with pytest.raises(ValueError, match="top_k"):
        with_defaults(SamplingParams(), set(), {"top_k": -5})


def _effective(log: str, request_id: str) -> dict:
    line = re.search(rf"request {request_id}: sampling SamplingParams\((.*)\)$", log, re.M).group(1)
    return {k: v for k, v in re.findall(r"(\w+)=([^,]+)", line)}


@pytest.mark.slow  # a server subprocess
def test_the_server_samples_with_the_checkpoints_defaults(model_dir, tmp_path):
    from dcpgraph.testing.server import running_server

    args = ("--dtype", "float32", "--block-size", "4", "--max-model-len", "64", "--log-level", "debug")
    with running_server(model_dir, *args, log_path=str(tmp_path / "serve.log")) as server:
        bodies = {"omitted": {"prompt": "hi", "max_tokens": 2},
                  "explicit": {"prompt": "hi", "max_tokens": 2, "temperature": 0.9, "top_k": 3, "top_p": 1.0}}
        ids = {}
        for name, body in bodies.items():
            r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            ids[name] = r.headers["x-request-id"]
        log = server.log()
    omitted, explicit = _effective(log, ids["omitted"]), _effective(log, ids["explicit"])
    assert (omitted["temperature"], omitted["top_k"], omitted["top_p"], omitted["repetition_penalty"],
            omitted["min_p"]) == ("0.25", "7", "0.9", "1.1", "0.05")
    assert (explicit["temperature"], explicit["top_k"], explicit["top_p"], explicit["repetition_penalty"]) == \
        ("0.9", "3", "1.0", "1.1")
