"""The sections of :class:`~dcpgraph.config.DcpgraphConfig`, one concern each: the checkpoint
(:class:`ModelConfig`), the mesh and where ranks run (:class:`ParallelConfig`), the paged KV cache
(:class:`CacheConfig`), the scheduler's budgets (:class:`SchedulerConfig`), the backend
(:class:`CompilationConfig`), speculative decoding (:class:`SpeculativeOptions`) and the server
(:class:`ServingConfig`). Each validates its own fields in ``__post_init__``."""

from __future__ import annotations

import dataclasses
import numbers
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..backends.device_graphs import CUDAGRAPH_MODES
from ..backends.registry import SPLIT_NEW_TOKENS, available_backends, resolve_backend
from ..capacity import KV_CACHE_DTYPE_ALIASES, KV_CACHE_DTYPES, canonical_kv_cache_dtype
from ..devices import DEVICE_CHOICES
from ..errors import ConfigError
from ..mesh import Mesh
from ..runtime.sampling_params import MAX_LOGPROBS
from ..runtime.speculative_config import SpeculativeConfig, speculative_config
from .fields import Section, option_name, setting

COMMS = ("auto", "a2a", "ag_rs", "ag")
EXECUTORS = ("auto", "emulated", "distributed")
DISTRIBUTED_EXECUTOR_BACKENDS = (None, "mp", "emulated")
KV_ALLOCATIONS = ("on_demand", "whole_request")
LOG_LEVELS = ("debug", "info", "warning", "error")
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")  # vLLM's --uvicorn-log-level
LOAD_FORMATS = ("auto", "safetensors", "dummy")  # where weights come from (vLLM's --load-format)
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder", "deepseek_v3")  # vLLM's names
REASONING_PARSERS = ("deepseek_r1", "qwen3", "granite", "gpt_oss")
IMPLEMENTED_REASONING_PARSERS = ("deepseek_r1", "qwen3")  # serving/reasoning.py
IMPLEMENTED_TOOL_CALL_PARSERS = ("hermes", "llama3_json")  # serving/tool_parsers.py
# the cache sizes, by their compile names; at most one may be given
CACHE_SIZE_OPTIONS = ("num_blocks", "kv_cache_tokens", "kv_cache_bytes_per_rank")
# dcpgraph.compile's own defaults for the fields whose config default (None) means "the front
# end's": LLM and serve take vLLM CPU's instead (dcpgraph.serving.vllm_defaults)
COMPILE_DEFAULTS = {"max_num_seqs": 8, "max_num_batched_tokens": 256, "enable_prefix_caching": False}
# older compile spelling -> the option that replaces it (accepted with a DeprecationWarning)


@dataclass(frozen=True)
class ModelConfig(Section):
    """The checkpoint: its directory, tokenizer, weight dtype and seed."""

    model: str | None = setting(None, "local HF model directory (config.json, safetensors weights, tokenizer)",
                                flags=("model",), option=None)
    tokenizer: str | None = setting(None, "tokenizer directory (default: the model's)", option=None)
    dtype: str = setting("auto", "auto (from the config), float32, bfloat16, float16, float64", option=None)
    seed: int = setting(0, "the run's seed (vLLM's): a request without its own seed samples from a generator "
                           "seeded by this seed and its request id, so the same requests in the same order give "
                           "the same tokens")
    trust_remote_code: bool = setting(False, "passed to transformers when the tokenizer is loaded; the model itself is "
                                             "always built from transformers' own classes (no remote code runs)",
                                      option=None)
    load_format: str = setting("auto", "where weights come from: auto/safetensors (the model directory's "
                                       "*.safetensors), dummy (random weights from the config alone, for "
                                       "benchmarking; no weight file is read)", choices=LOAD_FORMATS, option=None)
    quantization: str | None = setting(None, "the checkpoint's quantization method (vLLM's -q): checked against its "
                                             "config.json quantization_config (default: whatever it has)",
                                       flags=("--quantization", "-q"), option=None)

    def _validate(self) -> None:
        if self.load_format not in LOAD_FORMATS:
            raise ConfigError(f"load_format must be one of {list(LOAD_FORMATS)}, got {self.load_format!r}")


@dataclass(frozen=True)
class ParallelConfig(Section):
    """The mesh (TP, DCP and its interleave), expert parallelism and where ranks run."""

    tensor_parallel_size: int = setting(1, "tensor-parallel ranks", flags=("--tensor-parallel-size", "-tp"),
                                        option="tp")
    decode_context_parallel_size: int = setting(1, "ranks of a decode-context-parallel group (divides tp)",
                                                flags=("--decode-context-parallel-size", "-dcp"), option="dcp")
    prefill_context_parallel_size: int = setting(
        1, "prefill-context-parallel replicas of the TP group (the world is tp·pcp ranks); a prompt's tokens "
           "are split over them", flags=("--prefill-context-parallel-size", "-pcp"), option="pcp")
    cp_kv_cache_interleave_size: int = setting(1, "tokens per rank in turn along a DCP group's KV cache",
                                               option="interleave", low=1)
    enable_expert_parallel: bool = setting(False, "partition a MoE model's routed experts over the tensor-parallel "
                                                  "ranks instead of slicing every expert (with data_parallel_size "
                                                  "> 1: over every replica's ranks, DP attention + EP)")
    expert_replicas: Any = setting(
        None, "(D, d): compile replica d of D data-parallel replicas whose routed experts are partitioned over all "
              "of their ranks (set per replica by the serving front end for data_parallel_size with "
              "enable_expert_parallel)", cli=False)
    distributed_executor_backend: str | None = setting(
        None, "where tp > 1 ranks run: worker processes (mp, the default) or emulated in this process",
        choices=DISTRIBUTED_EXECUTOR_BACKENDS[1:], option=None)
    data_parallel_size: int = setting(1, "replicas of the deployment (each tp ranks with its own scheduler and KV "
                                         "cache) behind one server", flags=("--data-parallel-size", "-dp"),
                                      option=None, low=1)
    nnodes: int = setting(1, "machines the deployment spans: the tp ranks split evenly over them, or with "
                             "--data-parallel-size D each runs D/nnodes whole replicas",
                          option=None, low=1)
    node_rank: int = setting(0, "this machine's index among --nnodes: 0 is the head (the server, rank 0's "
                                "engine), the others run --headless", option=None, low=0)
    master_addr: str = setting("127.0.0.1", "the head's address every node reaches (with --nnodes > 1)",
                               option=None)
    master_port: int = setting(29501, "the head's port for the ranks' rendezvous (with --nnodes > 1); the "
                                      "head's worker connections listen on the next port", option=None, low=1)
    headless: bool = setting(False, "run this node's share of worker ranks only (every node but the head)",
                             option=None)
    device: str = setting("auto", "where ranks run: auto (an Ascend NPU if torch_npu imports and sees one, else "
                                  "CUDA, else the CPU; compile on an in-memory model: its parameters' device), cpu, "
                                  "cuda or npu; a rank takes its node's device local_rank mod count, and "
                                  "collectives use HCCL, NCCL or gloo", choices=DEVICE_CHOICES)
    executor: str = setting("auto", "compile's executor: auto, emulated or distributed (LLM picks it per process)",
                            cli=False)
    plan: Any = setting(None, "TP plan for plain modules: module-path pattern -> rule name", cli=False)

    def _validate(self) -> None:
        Mesh(self.tensor_parallel_size, self.decode_context_parallel_size,
             self.prefill_context_parallel_size)  # "tp must be a positive int, ..."
        self._validate_nodes()
        if self.device not in DEVICE_CHOICES:
            raise ConfigError(f"device must be one of {list(DEVICE_CHOICES)}, got {self.device!r}")
        if self.executor not in EXECUTORS:
            raise ConfigError(f"executor must be 'auto', 'emulated' or 'distributed', got {self.executor!r}")
        backend = self.distributed_executor_backend
        if backend not in DISTRIBUTED_EXECUTOR_BACKENDS:
            raise ConfigError(f"distributed_executor_backend must be one of {DISTRIBUTED_EXECUTOR_BACKENDS}, "
                              f"got {backend!r}")
        self._validate_expert_replicas()
        plan = self.plan
        if plan is not None and not (
            isinstance(plan, Mapping) and all(isinstance(k, str) and isinstance(v, str) for k, v in plan.items())
        ):
            raise ConfigError(f"plan must be None or a dict of module-path pattern -> rule name, got {plan!r}")

    def _validate_expert_replicas(self) -> None:
        value = self.expert_replicas
        if value is None:
            return
        ok = (isinstance(value, (tuple, list)) and len(value) == 2 and all(isinstance(v, int) for v in value)
              and value[0] >= 2 and 0 <= value[1] < value[0])
        if not ok:
            raise ConfigError(f"expert_replicas must be None or (D, d) with D >= 2 and 0 <= d < D, got {value!r}")
        if not self.enable_expert_parallel:
            raise ConfigError("expert_replicas partitions the routed experts over data-parallel replicas: it needs "
                              "enable_expert_parallel=True")
        if self.prefill_context_parallel_size > 1:
            raise ConfigError("expert_replicas with prefill_context_parallel_size > 1 is not supported: experts are "
                              "partitioned over replicas of one TP group each")

    def _validate_data_parallel(self) -> None:
        dp = self.data_parallel_size
        if dp % self.nnodes:
            raise ConfigError(f"data_parallel_size={dp} replicas do not split evenly over nnodes={self.nnodes} (each "
                              f"node runs whole replicas); use nnodes in {[n for n in range(1, dp + 1) if dp % n == 0]}")
        if self.distributed_executor_backend == "emulated":
            raise ConfigError(f"data_parallel_size={dp} runs each replica in its own worker processes; "
                              "distributed_executor_backend='emulated' cannot")
        if self.enable_expert_parallel and self.prefill_context_parallel_size > 1:
            raise ConfigError(f"data_parallel_size={dp} with enable_expert_parallel and prefill_context_parallel_size="
                              f"{self.prefill_context_parallel_size}: experts are partitioned over replicas of one "
                              "TP group each; use prefill_context_parallel_size=1")

    def _validate_nodes(self) -> None:
        nnodes, node, tp = self.nnodes, self.node_rank, self.tensor_parallel_size
        if not 0 <= node < nnodes:
            raise ConfigError(f"node_rank must be in [0, nnodes={nnodes}), got {node}")
        if tp % nnodes and self.data_parallel_size == 1:
            raise ConfigError(f"tensor_parallel_size={tp} ranks do not split evenly over nnodes={nnodes}; "
                              f"use nnodes in {[n for n in range(1, tp + 1) if tp % n == 0]}")
        if node > 0 and not self.headless:
            raise ConfigError(f"node_rank={node} runs worker ranks only: add --headless (node 0 is the head)")
        if node == 0 and self.headless:
            raise ConfigError("--headless is for the nodes other than the head: node_rank=0 runs the server "
                              "and rank 0's engine")
        if self.data_parallel_size > 1:
            self._validate_data_parallel()
        if nnodes > 1 and self.distributed_executor_backend == "emulated":
            raise ConfigError("distributed_executor_backend='emulated' runs every rank in one process: "
                              "it cannot span nnodes > 1")


@dataclass(frozen=True)
class CacheConfig(Section):
    """The paged KV cache: block size, element type, size, prefix caching, allocation."""

    block_size: int = setting(16, "tokens per KV block on each rank", low=1)
    kv_cache_dtype: str = setting(
        "auto", "KV cache element type: auto (the model's dtype), bf16, or fp8_e4m3 (one fp32 power-of-two scale "
                "per token, KV head and 128 elements); vLLM's fp8 and bfloat16 name the same",
        choices=(*KV_CACHE_DTYPES, *KV_CACHE_DTYPE_ALIASES))
    enable_prefix_caching: bool | None = setting(
        None, "reuse the KV of full virtual blocks shared with earlier prompts (default, as vLLM: on where the model "
              "supports it; off, with the reason logged, for recurrent layers and --hybrid-kv-cache)")
    num_gpu_blocks_override: int | None = setting(
        None, "KV cache size in blocks per rank (default: max-num-seqs sequences of max-model-len)",
        option="num_blocks", low=1)
    kv_cache_tokens: int | None = setting(None, "KV cache size in tokens (instead of a block count)", low=1)
    kv_cache_memory_bytes: int | None = setting(
        None, "KV cache size in bytes per rank, scales included (instead of --num-gpu-blocks-override)",
        option="kv_cache_bytes_per_rank", low=1)
    hybrid_kv_cache: bool = setting(False, "sliding-window layers get their own block table and a pool sized for "
                                           "their window (Gemma-2/3, GPT-OSS, Qwen3 hybrids: more requests in the "
                                           "same memory); not with --enable-prefix-caching")
    kv_cache_space_bytes: int | None = setting(
        None, "the default KV cache budget per rank when no cache size is given, on the host: this many bytes, "
              "without prefix caching no more blocks than max-num-seqs sequences of max-model-len take (LLM and "
              "serve: $VLLM_CPU_KVCACHE_SPACE GiB, else 4 GiB; None: max-num-seqs sequences of max-model-len)",
        low=1, cli=False)
    kv_allocation: str = setting("on_demand", "on_demand: blocks as requests grow; whole_request: prompt + max new "
                                              "tokens reserved at admission", choices=KV_ALLOCATIONS)
    gpu_memory_utilization: float | None = setting(
        None, "fraction of memory for weights, activations and KV cache; the KV cache takes what is left: "
              "(F x memory / ranks sharing it - weights - the activation peak of max-num-batched-tokens) / block "
              "bytes. Default: 0.9 on an accelerator; on the host (--device cpu) dcpgraph's default sizing unless "
              "given, where it is a fraction of the host memory available to this process (MemAvailable, cgroup) "
              "shared by this node's ranks. Not with the explicit cache sizes")

    def _validate(self) -> None:
        if self.enable_prefix_caching is not None and not isinstance(self.enable_prefix_caching, bool):
            raise ConfigError(f"enable_prefix_caching must be None (on where supported), True or False, "
                              f"got {self.enable_prefix_caching!r}")
        sizes = [option_name(f) for f in dataclasses.fields(self)
                 if option_name(f) in CACHE_SIZE_OPTIONS and getattr(self, f.name) is not None]
        if len(sizes) > 1:
            raise ConfigError(f"give at most one of {list(CACHE_SIZE_OPTIONS)}, got {sizes}")
        self._validate_utilization(sizes)
        if self.kv_allocation not in KV_ALLOCATIONS:
            raise ConfigError(f"kv_allocation must be one of {list(KV_ALLOCATIONS)}, got {self.kv_allocation!r}")
        dtype = canonical_kv_cache_dtype(self.kv_cache_dtype)
        if not isinstance(dtype, str) or dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)} (or vLLM's "
                              f"{sorted(KV_CACHE_DTYPE_ALIASES)} for the same caches), got {dtype!r}")
        object.__setattr__(self, "kv_cache_dtype", dtype)

    def _validate_utilization(self, sizes: list[str]) -> None:
        """``gpu_memory_utilization``: None or a number in (0, 1], and not with an explicit cache size
        (vLLM lets an explicit size win silently; here two sizes at once are a mistake to name)."""
        fraction = self.gpu_memory_utilization
        if fraction is None:
            return
        if not isinstance(fraction, numbers.Real) or isinstance(fraction, bool) or not 0 < fraction <= 1:
            raise ConfigError(f"gpu_memory_utilization must be a fraction in (0, 1], got {fraction!r}")
        if sizes:
            raise ConfigError(f"gpu_memory_utilization={fraction} and {sizes[0]} both size the KV cache "
                              f"(--gpu-memory-utilization and --{_flag_of(sizes[0])}); give one of them")
        object.__setattr__(self, "gpu_memory_utilization", float(fraction))


@dataclass(frozen=True)
class SchedulerConfig(Section):
    """Batching: requests and tokens per step, context length, waiting queue."""

    max_num_seqs: int | None = setting(
        None, "requests decoded together (default: vLLM CPU's, 128 x tp for serve, 256 x tp for LLM, at most "
              "--max-num-batched-tokens; dcpgraph.compile: 8)", low=1)
    max_num_batched_tokens: int | None = setting(
        None, "tokens per step, the chunked-prefill budget (default: vLLM CPU's, 2048 x tp for serve, 4096 x tp for "
              "LLM, at most max-num-seqs x max-model-len; dcpgraph.compile: 256)", low=1)
    max_model_len: int | None = setting(None, "longest prompt + output (default: the model's max_position_embeddings; "
                                              "dcpgraph.compile: at most 4096)", low=1)
    max_waiting: int = setting(1024, "bound of the waiting queue (past it a request is refused)", low=1)
    enable_chunked_prefill: bool | None = setting(
        None, "prefills are always chunked (--max-num-batched-tokens is the budget); --enable-chunked-prefill is "
              "accepted, --no-enable-chunked-prefill refused", option=None)

    def _validate(self) -> None:
        if self.enable_chunked_prefill is False:
            raise ConfigError("--no-enable-chunked-prefill: dcpgraph always chunks prefills within "
                              "--max-num-batched-tokens; raise that budget to prefill in fewer steps")


@dataclass(frozen=True)
class CompilationConfig(Section):
    """The compiler backend, its cache and the pass pipeline's switches."""

    backend: Any = setting("auto", "dcpgraph's compiler backend (default auto: torchair on Ascend, inductor on CUDA, "
                                   "eager on CPU); every decode bucket is compiled before the server listens",
                           choices=available_backends, parse=str)
    enforce_eager: bool = setting(False, "run the program eagerly: nothing is compiled at start-up (the 'eager' "
                                         "backend)", option=None)
    compile_cache_dir: str | None = setting(None, "a directory that keeps compiled graphs across processes and "
                                                  "restarts, so a second start-up compiles from it")
    capture_limit: int = setting(32, "largest decode batch given a static-shape graph (0: no graph mode)", low=0)
    cudagraph_mode: str = setting(
        "FULL_DECODE_ONLY", "on a CUDA device, each decode bucket's compiled graph captured as a CUDA graph and "
                            "replayed (FULL_DECODE_ONLY, the default) or not (NONE: compiled buckets, no capture); "
                            "nothing is captured on the CPU, on Ascend (the backend's own graphs) or under "
                            "--enforce-eager", flags=("--cudagraph-mode", "-O.cudagraph_mode"), choices=CUDAGRAPH_MODES)
    mlapo: bool = setting(True, "an MLA model's query/KV preprocessing as one mla_preprocess op per layer")
    fuse_linears: bool = setting(False, "linears that read one input (q/k/v, gate/up) as one linear over their "
                                        "weights concatenated, then slices (off: it measured no faster on CPU)")
    fuse_new_tokens: bool | None = setting(None, "read context and new tokens in one paged read (default: by "
                                                 "backend, not on the Ascend backends)")
    comm: str = setting("auto", "DCP's collectives", choices=COMMS)
    verify: bool = setting(True, "run the verifier after every pass")

    def _validate(self) -> None:
        if self.enforce_eager and self.backend not in ("auto", "eager"):
            raise ConfigError(f"--enforce-eager runs the 'eager' backend; it contradicts --backend {self.backend}")
        if self.cudagraph_mode not in CUDAGRAPH_MODES:
            raise ConfigError(f"cudagraph_mode must be one of {list(CUDAGRAPH_MODES)} (vLLM's PIECEWISE and FULL "
                              f"modes capture mixed steps, which dcpgraph does not), got {self.cudagraph_mode!r}")
        if self.comm not in COMMS:
            raise ConfigError(f"comm must be 'auto', 'a2a', 'ag_rs' or 'ag', got {self.comm!r}")
        cache_dir = self.compile_cache_dir
        if cache_dir is not None and not isinstance(cache_dir, (str, os.PathLike)):
            raise ConfigError(f"compile_cache_dir must be None or a directory path (str or os.PathLike), "
                              f"got {cache_dir!r}")
        object.__setattr__(self, "compile_cache_dir", None if cache_dir is None else os.fspath(cache_dir))
        name, _ = resolve_backend(self.effective_backend)  # raises ConfigError naming the backends
        _fuse_new_tokens(self.fuse_new_tokens, name)

    @property
    def effective_backend(self) -> Any:
        """The backend compile runs: ``"eager"`` under ``enforce_eager``, else ``backend``."""
        return "eager" if self.enforce_eager else self.backend

    @property
    def effective_fuse_new_tokens(self) -> bool:
        return _fuse_new_tokens(self.fuse_new_tokens, resolve_backend(self.effective_backend)[0])


@dataclass(frozen=True)
class SpeculativeOptions(Section):
    """Speculative decoding, vLLM's dict (checked into a SpeculativeConfig)."""

    speculative_config: Any = setting(
        None, 'speculative decoding, vLLM\'s JSON: {"method": "ngram"|"draft_model"|"mtp", '
              '"num_speculative_tokens": k, "model": DRAFT_DIR, "prompt_lookup_min"/"prompt_lookup_max": n}',
        parse="json")

    def _validate(self) -> None:
        object.__setattr__(self, "_checked", speculative_config(self.speculative_config))

    @property
    def checked(self) -> SpeculativeConfig | None:
        """The checked :class:`~dcpgraph.runtime.speculative_config.SpeculativeConfig` (None: off)."""
        return self._checked


@dataclass(frozen=True)
class ServingConfig(Section):
    """The HTTP server and the front end's connections to its worker processes."""

    host: str = setting("127.0.0.1", "interface the HTTP server listens on", option=None)
    port: int = setting(8000, "HTTP port", option=None, low=0)
    api_key: str | None = setting(None, "require 'Authorization: Bearer KEY' on /v1 routes "
                                        "(default: $DCPGRAPH_API_KEY, else vLLM's $VLLM_API_KEY)", option=None,
                                  env=("DCPGRAPH_API_KEY", "VLLM_API_KEY"))
    served_model_name: str | None = setting(None, "the model name clients use (default: MODEL)", option=None)
    worker_host: str = setting("127.0.0.1", "interface the front end's worker connections and the gloo world bind to",
                               option=None)
    worker_timeout_s: float = setting(600.0, "seconds to wait for a worker process", option=None)
    max_request_bytes: int = setting(1 << 28, "largest request body in bytes (vLLM has no bound; a long-context "
                                              "prompt as JSON token ids is ~7 bytes a token)", option=None, low=1)
    chat_template: str | None = setting(None, "a chat template (a Jinja file, or the template itself) used instead of "
                                              "the tokenizer's", option=None)
    max_logprobs: int = setting(20, "most log-probabilities a request may ask for per token (at most 20)",
                                option=None, low=0)
    disable_log_stats: bool = setting(False, "do not log the engine's state (requests, KV cache use, tokens per "
                                             "second) every 10 s", option=None)
    enable_log_requests: bool = setting(False, "log every request's sampling parameters and prompt token ids",
                                        option=None)
    generation_config: str = setting("auto", "where a request's omitted temperature/top_p/top_k/repetition_penalty/"
                                             "min_p come from: 'auto' (the model's generation_config.json), "
                                             "'vllm' (vLLM's neutral defaults) or a directory", option=None)
    enable_auto_tool_choice: bool = setting(False, "tool_choice \"auto\" (the default with tools): the "
                                                   "--tool-call-parser reads calls from the output",
                                            option=None)
    tool_call_parser: str | None = setting(None, "how tool_choice \"auto\" reads calls (hermes, llama3_json)",
                                           choices=TOOL_CALL_PARSERS, option=None)
    reasoning_parser: str | None = setting(None, "split chat outputs' <think>...</think> into message.reasoning "
                                                 "(qwen3, deepseek_r1)",
                                           choices=REASONING_PARSERS, option=None)
    kv_transfer_config: str | None = setting(
        None, "P/D disaggregation, vLLM's keys as JSON, e.g. '{\"kv_role\": \"kv_producer\", \"kv_rank\": 0, "
              "\"kv_parallel_size\": 2, \"kv_port\": 14579}' (see dcpgraph/serving/kv_connector/config.py)",
        option=None)
    log_level: str = setting("info", "server log level", choices=LOG_LEVELS, option=None)
    uvicorn_log_level: str | None = setting(None, "the HTTP server's (uvicorn's) log level (default: --log-level)",
                                            choices=UVICORN_LOG_LEVELS, option=None)

    def _validate(self) -> None:
        if self.log_level not in LOG_LEVELS:
            raise ConfigError(f"log_level must be one of {list(LOG_LEVELS)}, got {self.log_level!r}")
        if self.uvicorn_log_level is not None and self.uvicorn_log_level not in UVICORN_LOG_LEVELS:
            raise ConfigError(f"uvicorn_log_level must be one of {list(UVICORN_LOG_LEVELS)}, "
                              f"got {self.uvicorn_log_level!r}")
        if self.max_logprobs > MAX_LOGPROBS:
            raise ConfigError(f"max_logprobs must be at most {MAX_LOGPROBS} (the most a token returns), "
                              f"got {self.max_logprobs}")
        if self.reasoning_parser is not None and self.reasoning_parser not in IMPLEMENTED_REASONING_PARSERS:
            raise ConfigError(f"--reasoning-parser {self.reasoning_parser}: not implemented by dcpgraph serve; "
                              f"choose from {list(IMPLEMENTED_REASONING_PARSERS)}")
        if self.tool_call_parser is not None and self.tool_call_parser not in IMPLEMENTED_TOOL_CALL_PARSERS:
            raise ConfigError(f"--tool-call-parser {self.tool_call_parser}: not implemented by dcpgraph serve; "
                              f"choose from {list(IMPLEMENTED_TOOL_CALL_PARSERS)}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ConfigError("--enable-auto-tool-choice requires --tool-call-parser "
                              f"({' or '.join(IMPLEMENTED_TOOL_CALL_PARSERS)})")


SECTIONS: dict[str, type] = {
    "model": ModelConfig, "parallel": ParallelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
    "compilation": CompilationConfig, "speculative": SpeculativeOptions, "serving": ServingConfig,
}


def _flag_of(option: str) -> str:
    """The CLI spelling of the cache-size option ``option`` (compile's name)."""
    fields = {option_name(f): f for f in dataclasses.fields(CacheConfig)}
    return (fields[option].metadata["flags"] or ("--" + fields[option].name.replace("_", "-"),))[0].lstrip("-")


def _fuse_new_tokens(value: Any, backend: str) -> bool:
    """``fuse_new_tokens``: None (default) fuses except for the backends that cannot lower a fused
    read (:data:`dcpgraph.backends.registry.SPLIT_NEW_TOKENS`); True/False force it."""
    if value is None:
        return backend not in SPLIT_NEW_TOKENS
    if not isinstance(value, bool):
        raise ConfigError(f"fuse_new_tokens must be None (by backend), True or False, got {value!r}")
    if value and backend in SPLIT_NEW_TOKENS:
        raise ConfigError(f"fuse_new_tokens=True cannot lower on backend {backend!r}: its paged attention "
                          "takes no causal bound inside the cache; leave it None or False")
    return value
