"""guidellm (a load client vLLM users run) against a server on this machine: where its venv is,
the dataset it reads, its command line, and the per-request token counts it reports.

guidellm is not a dependency of dcpgraph: it pins an older ``click`` than the one installed here,
so it lives in a venv of its own (:func:`install_command`) that sees this interpreter's packages
(``--system-site-packages``: torch and transformers are not installed twice), found at
``$DCPGRAPH_GUIDELLM_VENV`` or :data:`DEFAULT_VENV`.

The dataset is a local jsonl of word prompts for :func:`dcpgraph.testing.vllm_bench.word_tokenizer`
(``w0 w1 ...``: each word one token), with the prompt and output token counts guidellm reads
(``prompt_tokens_count``, ``output_tokens_count``); for a fixed output length guidellm sends
``max_tokens`` with ``ignore_eos: true`` and ``stream_options.continuous_usage_stats``. Nothing is
downloaded: the tokenizer is the checkpoint's directory.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
from pathlib import Path

DEFAULT_VENV = "/opt/guidellm-venv"
VERSION = "0.8.1"


def guidellm_venv() -> Path:
    """Where guidellm's venv is (``$DCPGRAPH_GUIDELLM_VENV``, else :data:`DEFAULT_VENV`)."""
    return Path(os.environ.get("DCPGRAPH_GUIDELLM_VENV") or DEFAULT_VENV)


def install_command(venv: str | os.PathLike | None = None) -> str:
    """The shell command that installs guidellm into ``venv`` (default :func:`guidellm_venv`)."""
    v = os.fspath(venv or guidellm_venv())
    return f"python -m venv --system-site-packages {v} && {v}/bin/pip install guidellm=={VERSION}"


def guidellm_cli() -> Path | None:
    """The venv's ``guidellm`` command, or ``None`` where it is absent."""
    cli = guidellm_venv() / "bin" / "guidellm"
    return cli if cli.is_file() else None


def write_word_dataset(path: str | os.PathLike, *, rows: int, prompt_len: int, output_len: int, vocab_words: int,
                       seed: int = 0) -> str:
    """A jsonl of ``rows`` prompts of ``prompt_len`` random words ``w<i>`` (``i < vocab_words``),
    each asking for ``output_len`` tokens; returns ``path``."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(rows):
            prompt = " ".join(f"w{rng.randrange(vocab_words)}" for _ in range(prompt_len))
            f.write(json.dumps({"prompt": prompt, "prompt_tokens_count": prompt_len,
                                "output_tokens_count": output_len}) + "\n")
    return os.fspath(path)


def run_command(url: str, served_name: str, tokenizer_dir: str, data_path: str, output_path: str, *,
                endpoint: str, profile: str, requests: int) -> list[str]:
    """``guidellm run`` of ``requests`` requests from ``data_path`` to ``url``'s ``endpoint``
    (``/v1/completions`` or ``/v1/chat/completions``) under ``profile`` (guidellm's
    ``kind=...`` form, e.g. ``kind=synchronous`` or ``kind=constant,rate=2``), streamed; the
    report goes to ``output_path`` as JSON."""
    cli = guidellm_cli() or guidellm_venv() / "bin" / "guidellm"
    return [str(cli), "run",
            "--backend", f"kind=openai_http,target={url},model={served_name},request_format={endpoint}",
            "--profile", profile, "--constraint", f"kind=max_requests,count={requests}",
            "--data", f"kind=json_file,path={data_path}",
            "--tokenizer", f"kind=huggingface_auto,model={tokenizer_dir}",
            "--output", f"kind=json,path={output_path}", "--disable-console-interactive"]


def run_guidellm(command: list[str], log_path: str, output_path: str, timeout_s: float) -> dict:
    """Run ``command`` (from :func:`run_command`) without this checkout on ``PYTHONPATH`` and
    return its JSON report's first benchmark; raises ``RuntimeError`` with the end of its output
    if it fails or writes no report."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"HF_HUB_OFFLINE": "1"}
    with open(log_path, "w") as log:
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout_s,
                              cwd=os.path.dirname(os.path.abspath(output_path)))
    if done.returncode != 0 or not os.path.exists(output_path):
        with open(log_path, errors="replace") as f:
            raise RuntimeError(f"guidellm exited {done.returncode}:\n{f.read()[-4000:]}")
    with open(output_path) as f:
        return json.load(f)["benchmarks"][0]


def request_token_counts(benchmark: dict) -> tuple[list[tuple[int, int]], int, int]:
    """Each successful request's ``(prompt_tokens, output_tokens)`` as guidellm read them, and the
    numbers of errored and incomplete requests."""
    requests = benchmark["requests"]
    counts = [(r["prompt_tokens"], r["output_tokens"]) for r in requests["successful"]]
    return counts, len(requests["errored"]), len(requests["incomplete"])
