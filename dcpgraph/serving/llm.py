"""``LLM``: vLLM's offline API over a local HF model directory, text in and text out.

::

    from dcpgraph import LLM, SamplingParams
    llm = LLM(model="/models/DeepSeek-V2-Lite", tensor_parallel_size=2, decode_context_parallel_size=2)
    outputs = llm.generate(["The future of AI is"], SamplingParams(temperature=0.8, top_p=0.95))
    print(outputs[0].outputs[0].text)

Where the ranks run (``tp·pcp`` of them): one in this process; inside a ``torch.distributed``
world of size ``tp·pcp`` (``torchrun``) this process is one rank and every rank runs the same script
(on an accelerator it takes its node's device ``LOCAL_RANK mod count``);
otherwise one worker process per rank (:class:`~.workers.RemoteEngine`, real gloo collectives)
driven from here over loopback sockets. ``distributed_executor_backend="emulated"`` runs every
rank in this process instead (the SPMD emulator). Every check that can fail does so here, before
any rank starts (:func:`~.checkpoint.inspect_checkpoint`).

Unseeded sampled requests draw from a stream keyed by ``seed`` (vLLM's run seed, default 0) and
the engine's request id, so a fresh ``LLM`` with the same seed given the same calls reproduces the
same tokens, and another seed gives other ones.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from inspect import signature
from typing import Any

from ..api import facts_of
from ..checkpoints.files import weight_files
from ..checkpoints.loader import meta_model
from ..checkpoints.model_dir import inspect_checkpoint, load_tokenizer, require_model_dir
from ..checkpoints.tensor_sources import SafetensorsFiles
from ..config import DcpgraphConfig, config_fields, option_name
from ..devices import place_rank, resolve_device
from ..errors import ConfigError, RequestError
from ..mesh import Mesh
from ..pcp.support import refuse_pcp_execution
from ..runtime.grammar import GrammarBackend
from ..runtime.speculative_config import speculative_config
from ..speculative.mtp import check_mtp
from ..speculative.mtp_module import check_mtp_weights
from . import vllm_defaults
from .data_parallel import DataParallelEngine
from .detokenizer import TextStream
from .engine_config import EngineConfig, build_engine
from .expert_replicas import check_expert_replicas, start_expert_replicas
from .logprobs import vllm_logprobs, vllm_prompt_logprobs
from .nodes import NodeLayout
from .outputs import CompletionOutput, RequestOutput
from .params import SamplingParams
from .prefix_routing import PrefixAwareRouter
from .prompts import Prompt, as_prompt_list, chat_prompt, encode_prompt, truncated
from .vllm_defaults import FALLBACK_MAX_MODEL_LEN
from .workers import RemoteEngine, warm_fork_server

log = logging.getLogger("dcpgraph.serving")


def check_speculative_config(config: dict, info, *, tokenizer, **mesh) -> dict:
    """``config`` checked (:func:`dcpgraph.runtime.speculative_config.speculative_config`) before any rank
    starts; a draft model directory is inspected like the target (mesh, tensors, tokenizer) and
    must have the target's vocabulary. Returned as given: it travels to the ranks as JSON."""
    spec = speculative_config(config)
    if spec.method == "draft_model":
        if not isinstance(spec.model, str):
            raise ConfigError("LLM's speculative_config['model'] must be a model directory (it is loaded on every rank)")
        draft = inspect_checkpoint(spec.model, tokenizer=tokenizer, **mesh)
        if draft.vocab_size != info.vocab_size:
            raise ConfigError(f"draft model {spec.model}: vocabulary {draft.vocab_size} differs from the target's "
                              f"{info.vocab_size}; a draft must share the target's tokenizer")
    return dict(config)


def check_mtp_checkpoint(path: str) -> None:
    """``method="mtp"`` against the directory's config and safetensors names (before the
    checkpoint's own inspection, which would call MTP tensors of a small model unexpected)."""
    model = meta_model(path, None)
    check_mtp(facts_of(model), SafetensorsFiles(path, weight_files(path)).names(), model.config.num_hidden_layers)

    check_mtp_weights(path)


def check_quantization(path: str, given: str | None) -> None:
    """``quantization`` (vLLM's ``-q``), when given, must name the checkpoint's own method
    (``config.json``'s ``quantization_config.quant_method``; "none" for an unquantized one):
    dcpgraph does not quantize at load, it reads what the checkpoint holds."""
    if given is None:
        return
    with open(os.path.join(path, "config.json")) as f:
        quant = json.load(f).get("quantization_config") or {}
    method = quant.get("quant_method") or "none"
    if given != method:
        held = f"quantized with {method!r}" if quant else "not quantized"
        raise ConfigError(f"quantization={given!r}, but {path} is {held}: give quantization={method!r} or leave it "
                          "unset (dcpgraph reads the checkpoint's own weights and does not quantize at load)")


@dataclass(frozen=True)
class CheckedCheckpoint:
    """A model directory checked against the configuration: its tokenizer, what
    :func:`~dcpgraph.checkpoints.model_dir.inspect_checkpoint` found, and the record every rank
    builds its engine from."""

    tokenizer: Any
    info: Any
    config: EngineConfig
    defaults: vllm_defaults.VllmDefaults


def checked_checkpoint(settings: DcpgraphConfig, usage_context: str = "llm") -> CheckedCheckpoint:
    """Every check that can fail before a rank starts (the directory, the MTP layer, the tokenizer
    against the model, the mesh, the context length, a draft model), and the engine record, with
    vLLM CPU's defaults for ``usage_context`` ("llm" or "serve", :mod:`.vllm_defaults`) filled in."""
    model, parallel, cache, scheduler = settings.model.model, settings.parallel, settings.cache, settings.scheduler
    spec = settings.speculative
    require_model_dir(model)
    check_quantization(model, settings.model.quantization)
    load_format = settings.model.load_format
    if load_format == "dummy" and spec.checked is not None and spec.checked.method in ("mtp", "draft_model"):
        raise ConfigError(f"load_format='dummy' builds the target model only; speculative method "
                          f"{spec.checked.method!r} reads weights from a checkpoint: use 'ngram', or load_format "
                          "'auto'/'safetensors'")
    if spec.checked is not None and spec.checked.method == "mtp":
        check_mtp_checkpoint(model)
    tokenizer = load_tokenizer(settings.model.tokenizer or model, trust_remote_code=settings.model.trust_remote_code)
    tp, dcp = parallel.tensor_parallel_size, parallel.decode_context_parallel_size
    interleave = parallel.cp_kv_cache_interleave_size
    pcp = parallel.prefill_context_parallel_size
    info = inspect_checkpoint(model, dtype=settings.model.dtype, tp=tp, dcp=dcp, block_size=cache.block_size,
                              interleave=interleave, tokenizer=tokenizer, load_format=load_format, pcp=pcp)
    refuse_pcp_execution(Mesh(tp, dcp, pcp), data_parallel=parallel.data_parallel_size, nnodes=parallel.nnodes)
    limit = info.max_position_embeddings or FALLBACK_MAX_MODEL_LEN
    if scheduler.max_model_len is not None and not 0 < scheduler.max_model_len <= limit:
        raise ConfigError(f"max_model_len must be in [1, {limit}] (the model's max_position_embeddings), "
                          f"got {scheduler.max_model_len}")
    device = resolve_device(parallel.device).name
    sized = cache.gpu_memory_utilization is not None or any(  # a size, a fraction or the space itself given
        v is not None for v in (cache.num_gpu_blocks_override, cache.kv_cache_tokens, cache.kv_cache_memory_bytes,
                                cache.kv_cache_space_bytes))
    defaults = vllm_defaults.resolve(
        usage_context, tp=tp, model_limit=limit, max_model_len=scheduler.max_model_len,
        max_num_seqs=scheduler.max_num_seqs, max_num_batched_tokens=scheduler.max_num_batched_tokens, sized=sized,
        on_host=device == "cpu")
    if parallel.data_parallel_size > 1 and parallel.enable_expert_parallel:
        import transformers as tf

        check_expert_replicas(tf.AutoConfig.from_pretrained(model), tp=tp, replicas=parallel.data_parallel_size,
                              speculative=spec.speculative_config is not None,
                              device=device)
    engine_options = _engine_options(settings)
    engine_options["device"] = device  # every rank runs the front end's choice
    if defaults.kv_cache_space_bytes is not None:
        engine_options["kv_cache_space_bytes"] = defaults.kv_cache_space_bytes
    if spec.speculative_config is not None:
        engine_options["speculative_config"] = check_speculative_config(
            spec.speculative_config, info, dtype=info.dtype, tp=tp, dcp=dcp, pcp=pcp, block_size=cache.block_size,
            interleave=interleave, tokenizer=tokenizer)
    config = EngineConfig(
        model=model, dtype=info.dtype, tensor_parallel_size=tp, decode_context_parallel_size=dcp,
        prefill_context_parallel_size=pcp, cp_kv_cache_interleave_size=interleave, block_size=cache.block_size, max_model_len=defaults.max_model_len,
        enable_prefix_caching=cache.enable_prefix_caching, max_num_seqs=defaults.max_num_seqs,
        max_num_batched_tokens=defaults.max_num_batched_tokens, engine_options=engine_options,
        ranks_on_host=parallel.data_parallel_size * tp * pcp // parallel.nnodes, load_format=load_format,
    )
    return CheckedCheckpoint(tokenizer, info, config, defaults)


class LLM:
    def __init__(self, model: str, *, tokenizer: str | None = None, tensor_parallel_size: int = 1,
                 decode_context_parallel_size: int = 1, cp_kv_cache_interleave_size: int = 1,
                 prefill_context_parallel_size: int = 1,
                 block_size: int = 16, max_model_len: int | None = None, dtype: str = "auto",
                 enable_prefix_caching: bool | None = None, seed: int = 0, max_num_seqs: int | None = None,
                 max_num_batched_tokens: int | None = None, distributed_executor_backend: str | None = None,
                 worker_host: str = "127.0.0.1", worker_timeout_s: float = 600.0,
                 speculative_config: dict | None = None, trust_remote_code: bool = False,
                 quantization: str | None = None, usage_context: str = "llm", **engine_options: Any):
        """The arguments not given (None) take vLLM CPU's defaults for ``usage_context`` ("llm"; the
        server passes "serve"), see :mod:`.vllm_defaults`; the chosen figures are logged."""
        import torch.distributed as dist

        self.settings = settings = DcpgraphConfig.from_llm_kwargs(
            model=model, tokenizer=tokenizer, tensor_parallel_size=tensor_parallel_size,
            decode_context_parallel_size=decode_context_parallel_size,
            prefill_context_parallel_size=prefill_context_parallel_size,
            cp_kv_cache_interleave_size=cp_kv_cache_interleave_size, block_size=block_size,
            max_model_len=max_model_len, dtype=dtype, enable_prefix_caching=enable_prefix_caching, seed=seed,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            distributed_executor_backend=distributed_executor_backend, worker_host=worker_host,
            worker_timeout_s=worker_timeout_s, speculative_config=speculative_config,
            trust_remote_code=trust_remote_code, quantization=quantization, **engine_options,
        )  # every option checked, before the model directory is read
        parallel = settings.parallel
        world = parallel.tensor_parallel_size * parallel.prefill_context_parallel_size
        if (world > 1 or parallel.data_parallel_size > 1) and not (dist.is_available() and dist.is_initialized()):
            warm_fork_server()  # worker processes will be started: their fork server imports meanwhile
        checked = checked_checkpoint(settings, usage_context)
        self.tokenizer, self.info, self.config = checked.tokenizer, checked.info, checked.config
        self.defaults = checked.defaults
        self.seed = settings.model.seed
        self.max_model_len = checked.config.max_model_len
        self.eos_token_ids = checked.info.eos_token_ids
        in_world = dist.is_available() and dist.is_initialized() and dist.get_world_size() == world
        self._next_request = 0
        self.grammar_backend = None  # built on the first request with structured_outputs
        if parallel.data_parallel_size > 1:
            self.engine = DataParallelEngine(
                self._replicas(parallel.data_parallel_size), lockstep=parallel.enable_expert_parallel,
                router=PrefixAwareRouter(parallel.data_parallel_size, block_tokens=settings.cache.block_size))
        elif world == 1 or in_world:
            if self.config.device != "cpu":  # this process's rank: its node's device, LOCAL_RANK mod count
                place_rank(resolve_device(self.config.device), int(os.environ.get("LOCAL_RANK", "0")))
            self.engine = build_engine(self.config, "auto")
        elif parallel.distributed_executor_backend == "emulated":
            self.engine = build_engine(self.config, "emulated")
        else:
            self.engine = RemoteEngine(self.config, host=settings.serving.worker_host,
                                       timeout_s=settings.serving.worker_timeout_s, layout=NodeLayout.of(parallel))
        self._log_defaults()

    def _log_defaults(self) -> None:
        """Log the figures this LLM runs with (:meth:`.vllm_defaults.VllmDefaults.describe`), and keep
        ``settings`` the configuration as it runs (the defaults and the prefix-caching decision)."""
        prefix = self.engine.report()["prefix_cache"]
        given = self.settings.cache.enable_prefix_caching is not None
        log.info("%s", self.defaults.describe(bool(prefix.get("enabled")), prefix.get("off_reason"), given))
        self.settings = self.settings.replace(
            max_model_len=self.defaults.max_model_len, max_num_seqs=self.defaults.max_num_seqs,
            max_num_batched_tokens=self.defaults.max_num_batched_tokens,
            enable_prefix_caching=bool(prefix.get("enabled")))

    def _replicas(self, count: int) -> list[RemoteEngine]:
        """``count`` worker groups of ``tp`` ranks (one at a time; a failed start stops the started
        ones), each whole on one node (:class:`~.nodes.ReplicaPlacement`). Replicas that share the routed experts (``enable_expert_parallel``) start together,
        each compiling its own slice of the experts, since their ranks join one EP group."""
        serving = self.settings.serving
        nodes = NodeLayout.of(self.settings.parallel)
        if self.settings.parallel.enable_expert_parallel:
            return start_expert_replicas(self.config, count, host=serving.worker_host, timeout_s=serving.worker_timeout_s,
                                         nodes=nodes)
        replicas: list[RemoteEngine] = []
        try:
            for placement in nodes.replica_placements(count):
                replicas.append(RemoteEngine(self.config, host=serving.worker_host, timeout_s=serving.worker_timeout_s,
                                             layout=placement))
        except BaseException:
            for replica in replicas:
                replica.close()
            raise
        return replicas

    # -- generation --------------------------------------------------------------------------------
    def get_tokenizer(self):
        return self.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """One :class:`RequestOutput` per prompt, in order (see :mod:`.prompts` for the forms)."""
        items = [encode_prompt(self.tokenizer, p) for p in as_prompt_list(prompts)]
        return self._run(items, self._params_for(sampling_params, len(items)))

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = False, chat_template: str | None = None,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """``messages`` is one conversation (a list of ``{"role", "content"}``) or a list of them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        items = [chat_prompt(self.tokenizer, c, add_generation_prompt=add_generation_prompt,
                             chat_template=chat_template) for c in conversations]
        return self._run(items, self._params_for(sampling_params, len(items)))

    @staticmethod
    def _params_for(sampling_params, count: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * count
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * count
        if len(sampling_params) != count:
            raise ValueError(f"{len(sampling_params)} sampling_params for {count} prompts")
        return list(sampling_params)

    def prepare_structured_outputs(self, params: SamplingParams) -> None:
        """Compile ``params.structured_outputs`` here (a :class:`~dcpgraph.errors.GrammarError`
        naming the reason if it cannot be), building the tokenizer's grammar backend and handing
        it to the engine on the first such request; nothing for a request without one."""
        if params.structured_outputs is None:
            return
        if self.grammar_backend is None:
            backend = GrammarBackend.from_tokenizer(self.tokenizer, self.info.vocab_size, self.eos_token_ids)
            self.engine.enable_structured_outputs(backend)  # a remote client sends backend.serialize()
            self.grammar_backend = backend
        self.grammar_backend.compile(params.structured_outputs)

    def max_tokens_for(self, params: SamplingParams, prompt_len: int) -> int:
        """vLLM's rule: ``max_tokens=None`` means up to ``max_model_len``."""
        return params.max_tokens if params.max_tokens is not None else max(1, self.max_model_len - prompt_len)

    def _run(self, items: list[Prompt], params: list[SamplingParams]) -> list[RequestOutput]:
        streams: dict[int, tuple[int, int, TextStream]] = {}
        for sp in params:
            sp.update_from_tokenizer(self.tokenizer)  # bad_words -> their token ids
            self.prepare_structured_outputs(sp)
        items = [truncated(p, sp, self.max_model_len) for p, sp in zip(items, params)]
        for i, (prompt, sp) in enumerate(zip(items, params)):
            try:
                for j in range(sp.n):
                    sampling = sp.engine_params(j)
                    if j:  # the prompt's log-probabilities are the same for all n: completion 0 computes them
                        sampling.pop("prompt_logprobs", None)
                    rid = self.engine.add_request(prompt.token_ids, self.max_tokens_for(sp, len(prompt.token_ids)),
                                                  **sampling)
                    streams[rid] = (i, j, TextStream(self.tokenizer, sp, self.eos_token_ids))
            except RequestError as err:
                for rid in streams:
                    self.engine.abort(rid)
                err.args = (f"prompt {i}: {err}",)
                raise
        pending = set(streams)
        logprobs: dict[int, list[dict]] = {rid: [] for rid in streams}
        prompt_logprobs: dict[int, list] = {}  # per prompt, from its first completion's first event
        while pending:
            for event in self.engine.step():
                rid, token, engine_finished = event
                if rid not in pending:
                    continue
                stream = streams[rid][2]
                stream.add(token, engine_finished)
                logprobs[rid].append(event.logprobs)
                if event.prompt_logprobs is not None:
                    prompt_logprobs[streams[rid][0]] = event.prompt_logprobs
                if stream.finished:
                    pending.discard(rid)
                    if not engine_finished:
                        self.engine.abort(rid)
        outputs = []
        for i, prompt in enumerate(items):
            out = RequestOutput(str(self._next_request), prompt.text, list(prompt.token_ids))
            if params[i].prompt_logprobs is not None:
                out.prompt_logprobs = vllm_prompt_logprobs(self.tokenizer, prompt.token_ids, prompt_logprobs[i])
            self._next_request += 1
            for rid, (_, j, stream) in sorted(((k, v) for k, v in streams.items() if v[0] == i), key=lambda kv: kv[1][1]):
                completion = CompletionOutput(j, stream.text, list(stream.token_ids), stream.finish_reason)
                if params[i].logprobs is not None:
                    completion.logprobs = [vllm_logprobs(self.tokenizer, t, e)
                                           for t, e in zip(stream.token_ids, logprobs[rid], strict=True)]
                    completion.cumulative_logprob = sum(e["logprob"] for e in logprobs[rid])
                out.outputs.append(completion)
            outputs.append(out)
        return outputs

    # -- state ---------------------------------------------------------------------------------------
    def kv_usage_per_rank(self) -> list[float]:
        """Fraction of KV blocks in use on each rank (0 when nothing runs)."""
        return [used / total for used, total in self.engine.kv_usage_per_rank()]

    def num_kv_blocks(self) -> int:
        """KV blocks per rank, as allocated (the same on every rank)."""
        return int(self.engine.kv_usage_per_rank()[0][1])

    def shutdown(self) -> None:
        """Stop the worker processes (if any). The LLM cannot generate afterwards."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


# LLM's own arguments (vLLM's names, each a config field), and those llm_kwargs always gives
LLM_ARGUMENTS = tuple(p for p in signature(LLM.__init__).parameters
                      if p not in ("self", "model", "engine_options", "usage_context"))
_ALWAYS = ("tensor_parallel_size", "decode_context_parallel_size", "cp_kv_cache_interleave_size", "block_size",
           "max_model_len", "dtype", "enable_prefix_caching", "max_num_seqs", "max_num_batched_tokens", "worker_host")
# where the ranks run across machines (the parallel section's fields LLM takes by keyword)
NODE_FIELDS = ("data_parallel_size", "nnodes", "node_rank", "master_addr", "master_port", "headless")
# what EngineConfig carries in its own fields, by compile's names
_ENGINE_CONFIG_OPTIONS = ("tp", "dcp", "pcp", "interleave", "block_size", "max_model_len", "enable_prefix_caching",
                          "max_num_seqs", "max_num_batched_tokens")


def llm_kwargs(settings: DcpgraphConfig) -> dict[str, Any]:
    """``LLM(model=settings.model.model, **llm_kwargs(settings))`` builds ``settings`` again: LLM's
    own arguments (the mesh, cache and scheduler always, the rest when not their defaults) and, by
    compile's names, the compile options that differ from their defaults."""
    values, defaults = settings.values(), DcpgraphConfig().values()
    out = {name: values[name] for name in LLM_ARGUMENTS if name in _ALWAYS or values[name] != defaults[name]}
    fields = config_fields()
    taken = {option_name(fields[name][1]) for name in LLM_ARGUMENTS}
    out.update({k: v for k, v in settings.changed_compile_options().items() if k not in taken})
    out.update({k: values[k] for k in NODE_FIELDS if values[k] != defaults[k]})
    return out


def _engine_options(settings: DcpgraphConfig) -> dict[str, Any]:
    """The compile options an engine is built with beyond :class:`EngineConfig`'s own fields: those
    not at their defaults, by compile's names (JSON-able as given; they travel to every rank)."""
    changed = settings.changed_compile_options()
    return {k: v for k, v in changed.items() if k not in (*_ENGINE_CONFIG_OPTIONS, "speculative_config")}
