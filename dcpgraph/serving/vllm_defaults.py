"""The scheduler and cache defaults of :class:`~dcpgraph.LLM` and ``dcpgraph serve``: vLLM's CPU
build's (``EngineArgs.get_batch_defaults`` and ``_set_default_max_num_seqs_and_batched_tokens_args``
with chunked prefill, which dcpgraph always runs), so a vLLM command line or ``LLM(...)`` call
behaves the same here. ``dcpgraph.compile`` keeps its own small defaults
(:data:`dcpgraph.config.COMPILE_DEFAULTS`).

With ``world = tp`` (the ranks; pipeline parallelism is 1) and ``L = max_model_len``:

* ``max_model_len``: the model's limit (``max_position_embeddings``; 4096 when the config has none).
* ``max_num_batched_tokens = min(B · world, max_num_seqs · L)``, ``B`` = 4096 for ``LLM``, 2048
  for serve (vLLM's ``LLM_CLASS`` and ``OPENAI_API_SERVER`` usage contexts), where
  ``max_num_seqs`` is the one given or its default below.
* ``max_num_seqs = min(S · world, max_num_batched_tokens)``, ``S`` = 256 for ``LLM``, 128 for serve.
* prefix caching on where the model supports it; compile decides it off, with one reason the
  start-up line names, for compressed (V4) layers and ``hybrid_kv_cache``.
* KV cache on the host, when no size and no ``gpu_memory_utilization`` is given:
  ``$VLLM_CPU_KVCACHE_SPACE`` GiB per rank, else 4 GiB; without prefix caching no more blocks than
  ``max_num_seqs`` sequences of ``L`` take (a block past that is never used), with it all of them
  (finished requests' prefixes stay there for later hits, as in vLLM). Its pages are mapped lazily
  (:mod:`dcpgraph.runtime.host_memory`): memory is committed as blocks are written. On an
  accelerator ``gpu_memory_utilization`` 0.9 applies, as in vLLM.

A value given explicitly is kept as given. Remaining difference: the block size stays 16 (vLLM CPU
uses 128).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import ConfigError
from ..memory import size_text

USAGE_CONTEXTS = ("llm", "serve")
# per rank of the world, by usage context: (max_num_batched_tokens, max_num_seqs)
BATCH_DEFAULTS = {"llm": (4096, 256), "serve": (2048, 128)}
FALLBACK_MAX_MODEL_LEN = 4096  # a config without max_position_embeddings
KV_CACHE_SPACE_ENV = "VLLM_CPU_KVCACHE_SPACE"
DEFAULT_KV_CACHE_SPACE_GIB = 4


@dataclass(frozen=True)
class VllmDefaults:
    """The figures an ``LLM`` or server runs with and which of them were defaulted."""

    usage_context: str
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_cache_space_bytes: int | None  # None: a cache size or memory fraction was given, or not on the host
    kv_cache_space_source: str  # where kv_cache_space_bytes came from
    defaulted: tuple[str, ...]  # the fields that took a default

    def describe(self, prefix_caching: bool, off_reason: str | None, prefix_caching_given: bool) -> str:
        """The start-up line: every figure, marked ``(default)`` where vLLM's default chose it."""
        def mark(name: str) -> str:
            return " (default)" if name in self.defaulted else ""

        if prefix_caching:
            prefix = "on" + ("" if prefix_caching_given else " (default)")
        else:
            prefix = "off" + (f" (the default is on where supported; off here: {off_reason})" if off_reason
                              else "" if prefix_caching_given else " (default)")
        kv = (f"{size_text(self.kv_cache_space_bytes)} per rank at most ({self.kv_cache_space_source})"
              if self.kv_cache_space_bytes is not None else "as given")
        return (f"vLLM CPU defaults ({self.usage_context}): max_model_len={self.max_model_len}{mark('max_model_len')}, "
                f"max_num_seqs={self.max_num_seqs}{mark('max_num_seqs')}, "
                f"max_num_batched_tokens={self.max_num_batched_tokens}{mark('max_num_batched_tokens')}, "
                f"prefix caching {prefix}, KV cache {kv}")


def kv_cache_space_bytes(environ: Mapping[str, str] | None = None) -> tuple[int, str]:
    """``(bytes, source)``: ``$VLLM_CPU_KVCACHE_SPACE`` GiB (a positive number) if set and not
    empty, else :data:`DEFAULT_KV_CACHE_SPACE_GIB` GiB."""
    environ = os.environ if environ is None else environ
    text = environ.get(KV_CACHE_SPACE_ENV, "").strip()
    if not text:
        return DEFAULT_KV_CACHE_SPACE_GIB << 30, f"{KV_CACHE_SPACE_ENV} unset: vLLM CPU's {DEFAULT_KV_CACHE_SPACE_GIB} GiB"
    try:
        gib = float(text)
    except ValueError:
        gib = -1.0
    if not gib > 0:
        raise ConfigError(f"{KV_CACHE_SPACE_ENV}={text!r}: give the KV cache space per rank in GiB, a number > 0 "
                          f"(unset: {DEFAULT_KV_CACHE_SPACE_GIB} GiB)")
    return int(gib * (1 << 30)), f"{KV_CACHE_SPACE_ENV}={text} GiB"


def resolve(usage_context: str, *, tp: int, model_limit: int | None, max_model_len: int | None,
            max_num_seqs: int | None, max_num_batched_tokens: int | None, sized: bool, on_host: bool,
            environ: Mapping[str, str] | None = None) -> VllmDefaults:
    """The module docstring's formulas for the values not given (None). ``sized``: a cache size or
    ``gpu_memory_utilization`` was given; ``on_host``: the ranks run on the CPU."""
    if usage_context not in BATCH_DEFAULTS:
        raise ConfigError(f"usage_context must be one of {list(USAGE_CONTEXTS)}, got {usage_context!r}")
    tokens_per_rank, seqs_per_rank = BATCH_DEFAULTS[usage_context]
    defaulted = []
    if max_model_len is None:
        max_model_len = model_limit or FALLBACK_MAX_MODEL_LEN
        defaulted.append("max_model_len")
    seqs = max_num_seqs if max_num_seqs is not None else seqs_per_rank * tp
    if max_num_batched_tokens is None:
        max_num_batched_tokens = min(tokens_per_rank * tp, seqs * max_model_len)
        defaulted.append("max_num_batched_tokens")
    if max_num_seqs is None:
        max_num_seqs = min(seqs, max_num_batched_tokens)
        defaulted.append("max_num_seqs")
    space, source = (None, "as given") if sized or not on_host else kv_cache_space_bytes(environ)
    return VllmDefaults(usage_context, int(max_model_len), int(max_num_seqs), int(max_num_batched_tokens), space,
                        source, tuple(defaulted))
