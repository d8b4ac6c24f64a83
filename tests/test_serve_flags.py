"""``dcpgraph serve``'s engine flags in vLLM's spelling (``--kv-cache-dtype``,
``--enable-expert-parallel``, ``--enforce-eager``) and dcpgraph's own (``--backend``,
``--compile-cache-dir``): what each becomes in :class:`~dcpgraph.LLM`'s options, that the engine
is built with it, and that a running server reports the KV cache it was started with in vLLM's
``cache_config_info`` gauge.

References: the compile options each flag names (:func:`dcpgraph.options.compile_options` is the
one place that validates them), the cache tensors the engine allocated, and the offline
:class:`~dcpgraph.LLM` built with the same options, whose greedy tokens the server must give.
"""

from __future__ import annotations

import httpx
import pytest

from dcpgraph import LLM, ConfigError, SamplingParams
from dcpgraph.config import DcpgraphConfig
from dcpgraph.serving.cli import build_parser, llm_options
from dcpgraph.serving.metrics import Metrics, cache_config_info

SMALL = ("--dtype", "bfloat16", "--block-size", "4", "--max-model-len", "64")


def options_of(*flags: str) -> dict:
    return llm_options(build_parser().parse_args(["/m", *flags]))


def test_defaults_add_no_engine_options():
    options = options_of()
    for key in ("kv_cache_dtype", "enable_expert_parallel", "hybrid_kv_cache", "backend", "compile_cache_dir",
                "kv_cache_bytes_per_rank"):
        assert key not in options, key


def test_each_flag_becomes_its_compile_option(tmp_path):
    assert options_of("--kv-cache-dtype", "fp8_e4m3")["kv_cache_dtype"] == "fp8_e4m3"
    assert options_of("--kv-cache-dtype", "bf16")["kv_cache_dtype"] == "bf16"
    assert options_of("--kv-cache-dtype", "fp8")["kv_cache_dtype"] == "fp8_e4m3"  # vLLM's alias
    assert options_of("--kv-cache-dtype", "bfloat16")["kv_cache_dtype"] == "bf16"
    assert options_of("--enable-expert-parallel")["enable_expert_parallel"] is True
    assert options_of("--hybrid-kv-cache")["hybrid_kv_cache"] is True
    assert options_of("--enforce-eager")["backend"] == "eager"
    assert options_of("--backend", "inductor")["backend"] == "inductor"
    assert options_of("--enforce-eager", "--backend", "eager")["backend"] == "eager"
    assert options_of("--compile-cache-dir", str(tmp_path))["compile_cache_dir"] == str(tmp_path)
    assert options_of("--kv-cache-memory-bytes", "1048576")["kv_cache_bytes_per_rank"] == 1 << 20


def test_contradicting_or_unknown_flags_are_refused_before_any_work(capsys, checkpoints):
    with pytest.raises(ConfigError, match=r"give at most one of \['num_blocks', 'kv_cache_tokens', 'kv_cache_bytes_per_rank'\]"):
        LLM(model=checkpoints["qwen3"], **options_of(*SMALL, "--num-gpu-blocks-override", "64",
                                                     "--kv-cache-memory-bytes", "1048576"))
    with pytest.raises(ConfigError, match=r"--enforce-eager runs the 'eager' backend; it contradicts --backend inductor"):
        options_of("--enforce-eager", "--backend", "inductor")
    for flags in (["--kv-cache-dtype", "fp8_e5m2"], ["--kv-cache-dtype", "int8"], ["--backend", "tvm"]):
        with pytest.raises(SystemExit):
            options_of(*flags)
        assert "invalid choice" in capsys.readouterr().err


def test_metrics_carry_the_cache_config_vllm_names():
    config = DcpgraphConfig.from_llm_kwargs(
        model="/m", dtype="bfloat16", tensor_parallel_size=2, decode_context_parallel_size=2,
        cp_kv_cache_interleave_size=4, block_size=16, enable_prefix_caching=True, kv_cache_dtype="fp8",
        num_gpu_blocks_override=512, enforce_eager=True)
    text = Metrics("tiny", cache_config_info(config, 512)).render(
        {"running": 0, "waiting": 0, "kv_usage": [0.0, 0.0]})
    from prometheus_client.parser import text_string_to_metric_families

    info = [s for f in text_string_to_metric_families(text) for s in f.samples if s.name == "vllm:cache_config_info"]
    assert len(info) == 1 and info[0].value == 1
    labels = info[0].labels
    assert labels == {"model_name": "tiny", "engine": "0", "block_size": "16", "cache_dtype": "fp8_e4m3",
                      "enable_prefix_caching": "True", "num_gpu_blocks": "512", "tensor_parallel_size": "2",
                      "decode_context_parallel_size": "2", "cp_kv_cache_interleave_size": "4", "backend": "eager",
                      "gpu_memory_utilization": "None", "kv_cache_memory_bytes": ""}
    default = cache_config_info(DcpgraphConfig.from_llm_kwargs(model="/m"), 96)
    assert (default["cache_dtype"], default["num_gpu_blocks"], default["backend"]) == ("auto", "96", "auto")


def test_the_offline_llm_built_from_the_flags_has_an_fp8_cache(checkpoints):
    llm = LLM(model=checkpoints["qwen3"], **options_of(*SMALL, "--kv-cache-dtype", "fp8_e4m3", "--backend", "aot_eager",
                                                     "--max-num-seqs", "1"))
    try:
        caches = llm.engine.executor.rank_caches(0)
        dtypes = {str(c.dtype) for c in caches.values()}
        assert dtypes == {"torch.float8_e4m3fn", "torch.float32"}, dtypes  # the data and their scales
        assert any(name.endswith("_scale") for name in caches)
        assert llm.engine.report()["backend"] == "aot_eager"  # not the CPU default (eager)
        out = llm.generate(["The future of AI is"], SamplingParams(temperature=0, max_tokens=6))[0].outputs[0]
        assert 1 <= len(out.token_ids) <= 6 and out.finish_reason in ("stop", "length")
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_a_server_started_with_an_fp8_cache_reports_it_and_answers_as_the_offline_llm(checkpoints, tmp_path):
    from dcpgraph.testing.server import running_server

    path = checkpoints["qwen3"]
    flags = ("--kv-cache-dtype", "fp8_e4m3", "--enforce-eager", "--enable-prefix-caching")
    prompt = [72, 105, 33, 7, 64]
    offline = LLM(model=path, usage_context="serve", **options_of(*SMALL, *flags))  # serve's defaults, as the server
    try:
        blocks = offline.num_kv_blocks()
        want = offline.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0]
    finally:
        offline.shutdown()
    with running_server(path, *SMALL, *flags, log_path=str(tmp_path / "serve.log")) as server:
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(server.url + "/metrics", timeout=10).text
        info = [s for f in text_string_to_metric_families(text) for s in f.samples if s.name == "vllm:cache_config_info"]
        assert [(s.labels["cache_dtype"], s.labels["num_gpu_blocks"], s.value) for s in info] == \
            [("fp8_e4m3", str(blocks), 1)]
        body = {"model": path, "prompt": prompt, "max_tokens": 8, "temperature": 0}
        got = httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()["choices"][0]
        assert (got["text"], got["finish_reason"]) == (want.text, want.finish_reason)


# -- the flags are generated from the configuration's fields ---------------------------------------
def _flag_dests(parser) -> dict[str, list[str]]:
    return {a.dest: list(a.option_strings) or [a.dest] for a in parser._actions if a.dest != "help"}


def test_every_config_field_has_a_flag_and_every_flag_a_field():
    from dcpgraph.config import config_fields

    fields = config_fields()
    dests = _flag_dests(build_parser())
    # the fields a command line cannot express: compile's executor (LLM picks it per process),
    # a plain module's TP plan (a serve model is always a checkpoint with its own plan) and which
    # replica's slice of the experts a worker compiles (set per replica by the front end)
    no_flag = {name for name, (_, f) in fields.items() if not f.metadata["cli"]}
    # and the default KV budget, which LLM and serve set from $VLLM_CPU_KVCACHE_SPACE
    assert no_flag == {"executor", "plan", "expert_replicas", "kv_cache_space_bytes"}
    assert set(dests) == set(fields) - no_flag  # no flag without a field, no field without a flag
    assert dests["tensor_parallel_size"] == ["--tensor-parallel-size", "-tp"]
    assert dests["decode_context_parallel_size"] == ["--decode-context-parallel-size", "-dcp"]
    assert dests["model"] == ["model"]


def test_a_flag_without_a_field_cannot_exist():
    """build_parser is add_cli_args and nothing else: a hand-added flag would have no field and
    from_cli_args would never read it; the field set is the parser's."""
    import argparse

    from dcpgraph.config import DcpgraphConfig
    from dcpgraph.serving.cli_args import add_cli_args

    parser = add_cli_args(argparse.ArgumentParser())
    parser.add_argument("--not-a-field", default=1)
    args = parser.parse_args(["/m", "--not-a-field", "2"])
    assert "not_a_field" not in DcpgraphConfig.from_cli_args(args).values()
    assert "not_a_field" not in _flag_dests(build_parser())


def test_booleans_have_negative_flags():
    assert options_of("--enable-prefix-caching")["enable_prefix_caching"] is True
    assert options_of("--enable-prefix-caching", "--no-enable-prefix-caching")["enable_prefix_caching"] is False
    assert "hybrid_kv_cache" not in options_of("--hybrid-kv-cache", "--no-hybrid-kv-cache")
    assert "backend" not in options_of("--enforce-eager", "--no-enforce-eager")
    assert options_of("--no-mlapo")["mlapo"] is False  # a compile option serve could not set before
    assert options_of("--no-fuse-new-tokens")["fuse_new_tokens"] is False
    assert "fuse_new_tokens" not in options_of()


def test_serve_llm_and_compile_build_the_same_config():
    from dcpgraph.config import DcpgraphConfig
    from dcpgraph.serving.llm import llm_kwargs

    flags = ["/m", "-tp", "2", "-dcp", "2", "--cp-kv-cache-interleave-size", "4", "--block-size", "8",
             "--kv-cache-dtype", "fp8", "--num-gpu-blocks-override", "64", "--enforce-eager", "--comm", "ag",
             "--capture-limit", "4"]
    # without these three, serve and LLM leave them None (vLLM CPU's defaults, resolved against the
    # model at start-up) where compile takes its own 8, 256 and False
    unset = DcpgraphConfig.from_cli_args(build_parser().parse_args(flags)).compile_options()
    assert (unset["max_num_seqs"], unset["max_num_batched_tokens"], unset["enable_prefix_caching"]) == (None,) * 3
    flags += ["--max-num-seqs", "8", "--max-num-batched-tokens", "256", "--no-enable-prefix-caching"]
    served = DcpgraphConfig.from_cli_args(build_parser().parse_args(flags))
    offline = DcpgraphConfig.from_llm_kwargs(model="/m", **llm_kwargs(served))
    compiled = DcpgraphConfig.from_compile_options(tp=2, dcp=2, interleave=4, block_size=8, kv_cache_dtype="fp8_e4m3",
                                                   num_blocks=64, backend="eager", comm="ag", capture_limit=4)
    # --enforce-eager reaches LLM as backend="eager" (its compile option): the same compile
    assert offline.compile_options() == served.compile_options() == compiled.compile_options()
    for section in ("model", "parallel", "cache", "scheduler", "speculative", "serving"):
        assert getattr(offline, section) == getattr(served, section), section
    assert served.cache.num_gpu_blocks_override == 64 and served.parallel.cp_kv_cache_interleave_size == 4


def test_api_key_defaults_from_the_environment(monkeypatch):
    from dcpgraph.config import DcpgraphConfig

    monkeypatch.setenv("DCPGRAPH_API_KEY", "sekrit")
    assert DcpgraphConfig.from_cli_args(build_parser().parse_args(["/m"])).serving.api_key == "sekrit"
    monkeypatch.delenv("DCPGRAPH_API_KEY")
    assert DcpgraphConfig.from_cli_args(build_parser().parse_args(["/m"])).serving.api_key is None


def test_quantization_must_name_the_checkpoints_own_method(tmp_path):
    """``-q``/``--quantization`` is checked against config.json before anything is loaded."""
    import json

    from dcpgraph.serving.llm import check_quantization

    plain, fp8 = tmp_path / "plain", tmp_path / "fp8"
    plain.mkdir()
    fp8.mkdir()
    (plain / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    (fp8 / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "fp8"}}))
    check_quantization(str(fp8), "fp8")
    check_quantization(str(plain), "none")
    check_quantization(str(plain), None)
    with pytest.raises(ConfigError, match=r"quantization='awq', but .*fp8 is quantized with 'fp8': give "
                                          r"quantization='fp8' or leave it unset"):
        check_quantization(str(fp8), "awq")
    with pytest.raises(ConfigError, match=r"quantization='fp8', but .*plain is not quantized: give quantization='none'"):
        LLM(str(plain), quantization="fp8")  # refused before the tokenizer or any weight is read
    assert DcpgraphConfig.from_cli_args(build_parser().parse_args(["/m", "-q", "fp8"])).model.quantization == "fp8"


def test_uvicorn_log_level_is_its_own_flag():
    args = build_parser().parse_args(["/m", "--uvicorn-log-level", "warning"])
    assert DcpgraphConfig.from_cli_args(args).serving.uvicorn_log_level == "warning"
    assert DcpgraphConfig.from_cli_args(build_parser().parse_args(["/m"])).serving.uvicorn_log_level is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["/m", "--uvicorn-log-level", "loud"])
