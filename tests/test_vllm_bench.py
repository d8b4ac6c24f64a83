"""vLLM's own load client, ``vllm bench serve`` (random dataset, ``--ignore-eos``, the ``openai``
and ``openai-chat`` backends), against a real ``dcpgraph serve`` on a head_dim-64 Qwen3
checkpoint: every request must succeed, and the token counts the client reads from the stream's
usage must be the ones it asked for.

vLLM is not installed with dcpgraph: it runs from its own venv (``$DCPGRAPH_VLLM_VENV`` or
/opt/vllm-venv; the install command is :func:`dcpgraph.testing.vllm_bench.install_command`, and
docs/testing.md); without it these tests skip and say how to install it.
"""

from __future__ import annotations

import pytest

from dcpgraph.testing.server import running_server
from dcpgraph.testing.vllm_bench import (
    bench_command,
    install_command,
    run_bench,
    save_word_checkpoint,
    vllm_cli,
    vllm_venv,
)

pytestmark = pytest.mark.slow
PROMPTS, INPUT_LEN, OUTPUT_LEN, CONCURRENCY = 8, 64, 16, 4


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if vllm_cli() is None:
        pytest.skip(f"no vLLM venv at {vllm_venv()} (set DCPGRAPH_VLLM_VENV, or install it: {install_command()})")
    root = tmp_path_factory.mktemp("vllm_bench")
    model = save_word_checkpoint(root / "model")
    with running_server(model, "--served-model-name", "tiny", "--max-model-len", "1024",
                        log_path=str(root / "server.log")) as s:
        s.model_dir, s.root = model, root
        yield s


@pytest.mark.parametrize("backend", ["openai", "openai-chat"])
def test_vllm_bench_serve_has_no_failed_request(server, backend):
    command = bench_command(server.url, server.model_dir, "tiny", backend=backend, num_prompts=PROMPTS,
                            input_len=INPUT_LEN, output_len=OUTPUT_LEN, concurrency=CONCURRENCY,
                            result_dir=str(server.root), result_file=f"{backend}.json")
    result = run_bench(command, str(server.root / f"{backend}.log"), timeout_s=600)
    errors = [e for e in result.get("errors", []) if e]
    assert (result["completed"], result["failed"]) == (PROMPTS, 0), errors[:3] or server.log()[-3000:]
    assert result["total_output_tokens"] == PROMPTS * OUTPUT_LEN  # ignore_eos honoured, usage counted
    if backend == "openai":  # a chat prompt adds the template's tokens
        assert result["total_input_tokens"] == PROMPTS * INPUT_LEN
    assert result["mean_ttft_ms"] > 0 and result["mean_tpot_ms"] > 0
