"""guidellm (``guidellm run``) against a real ``dcpgraph serve`` on a word-tokenizer Qwen3
checkpoint whose directory is the client's tokenizer (no hub download): a synchronous run on
``/v1/completions`` and a constant-rate run on ``/v1/chat/completions``, both with fixed output
lengths (guidellm sends ``ignore_eos`` and ``stream_options.continuous_usage_stats``). Every
request must succeed and the token counts guidellm reports must be the ones it asked for.

guidellm runs from its own venv (``$DCPGRAPH_GUIDELLM_VENV`` or /opt/guidellm-venv; the install
command is :func:`dcpgraph.testing.guidellm.install_command`); without it these tests skip and say
how to install it.
"""

from __future__ import annotations

import pytest

from dcpgraph.testing.guidellm import (
    guidellm_cli,
    guidellm_venv,
    install_command,
    request_token_counts,
    run_command,
    run_guidellm,
    write_word_dataset,
)
from dcpgraph.testing.server import running_server
from dcpgraph.testing.vllm_bench import ModelShape, save_word_checkpoint

pytestmark = pytest.mark.slow
REQUESTS, PROMPT_LEN, OUTPUT_LEN = 4, 32, 8


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if guidellm_cli() is None:
        pytest.skip(f"no guidellm venv at {guidellm_venv()} (set DCPGRAPH_GUIDELLM_VENV, or install it: "
                    f"{install_command()})")
    root = tmp_path_factory.mktemp("guidellm")
    model = save_word_checkpoint(root / "model", ModelShape(layers=1))
    with running_server(model, "--served-model-name", "tiny", "--max-model-len", "512",
                        log_path=str(root / "server.log")) as s:
        s.model_dir, s.root = model, root
        yield s


@pytest.mark.parametrize("endpoint,profile", [("/v1/completions", "kind=synchronous"),
                                              ("/v1/chat/completions", "kind=constant,rate=4")])
def test_guidellm_run_completes_with_the_asked_token_counts(server, endpoint, profile):
    name = endpoint.rsplit("/", 1)[1]
    data = write_word_dataset(server.root / f"{name}.jsonl", rows=REQUESTS, prompt_len=PROMPT_LEN,
                              output_len=OUTPUT_LEN, vocab_words=ModelShape().vocab - 8)
    output = str(server.root / f"{name}.json")
    command = run_command(server.url, "tiny", server.model_dir, data, output, endpoint=endpoint, profile=profile,
                          requests=REQUESTS)
    benchmark = run_guidellm(command, str(server.root / f"{name}.log"), output, timeout_s=300)
    counts, errored, incomplete = request_token_counts(benchmark)
    assert (len(counts), errored, incomplete) == (REQUESTS, 0, 0), server.log()[-3000:]
    assert [out for _, out in counts] == [OUTPUT_LEN] * REQUESTS  # ignore_eos honoured, usage read
    if endpoint == "/v1/completions":  # a chat prompt adds the template's tokens
        assert [prompt for prompt, _ in counts] == [PROMPT_LEN] * REQUESTS
    else:
        assert all(prompt > PROMPT_LEN for prompt, _ in counts)
