"""The OpenAI-compatible HTTP API on FastAPI: ``/v1/models``, ``/v1/completions``,
``/v1/chat/completions`` (``stream`` as server-sent events or one JSON body), ``/health``, ``/metrics``,
and vLLM's ``/tokenize``, ``/detokenize``, ``/version``, ``/ping`` (GET and POST), ``/load``
(``{"server_load": completion and chat requests in flight}``) and ``/reset_prefix_cache`` (POST).

Every request gets an id (``cmpl-…`` / ``chatcmpl-…``, followed by the client's ``X-Request-Id``
header where it sent one, as vLLM) that its log lines and its ``X-Request-Id`` header carry. Bodies are read with a size bound before JSON parsing (413 past it),
then validated strictly (:mod:`.protocol`); every refusal is OpenAI's error shape
``{"error": {"message", "type", "param", "code"}}``: 400 for bad input (malformed JSON, unknown
sampling values, a prompt or ``max_tokens`` past ``max_model_len``; unknown fields are ignored and
logged, as vLLM does: :mod:`.protocol`), 401 for a
missing or wrong API key on ``/v1`` routes, 404 for an unknown model name, 503 once the engine has
failed. Engine errors map by class (:func:`status_for`): any ``RequestError`` is a 400 unless its
class (or a base) is listed in :data:`~.api_errors.STATUS_BY_ERROR_NAME` (a queue-full error is a 429) or
defines ``http_status``. A client that goes away has its requests aborted at once: mid-stream, or
while waiting for a non-streamed body (watched every :data:`DISCONNECT_POLL_S`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from ..errors import KVTransferError, RequestError
from ..runtime.sampling_params import MAX_LOGPROBS
from .api_errors import ApiError, error_body, status_for
from .engine_loop import EngineDeadError, EngineLoop, Piece
from .generation_defaults import generation_defaults, with_defaults
from .metrics import CONTENT_TYPE, Metrics, cache_config_info
from .middleware import Authenticate, CountInFlight
from .prompts import Prompt, chat_prompt, encode_prompt, truncated
from .protocol import ChatCompletionRequest, CompletionRequest
from .reasoning import ReasoningParser
from .responses import Reply
from .tokenization import (
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    tokenize_request,
)
from .tools import AUTO_NEEDS_PARSER

log = logging.getLogger("dcpgraph.serving")
DISCONNECT_POLL_S = 0.25
STATS_EVERY_S = 10.0  # vLLM's stats logging interval
LOG_PROMPT_IDS = 64  # prompt ids a --enable-log-requests line shows per prompt
MAX_REQUEST_ID = 128  # characters of a client's X-Request-Id kept


def check_kv_transfer(kv_agent, kv: dict, prompts: list, params, stream: bool) -> None:
    """Refuse (400) ``kv_transfer_params`` this instance or request cannot honour."""
    if kv_agent is None:
        raise ApiError(400, "kv_transfer_params given, but this server was started without --kv-transfer-config",
                       param="kv_transfer_params")
    if len(prompts) != 1 or params.n != 1:
        raise ApiError(400, "kv_transfer_params take one prompt and n=1", param="kv_transfer_params")
    if kv.get("do_remote_decode"):
        if not kv_agent.config.is_producer or stream:
            raise ApiError(400, f"do_remote_decode needs a kv_producer or kv_both instance (this one is "
                                f"{kv_agent.config.kv_role}) and stream=false", param="kv_transfer_params")
    elif "transfer_id" in kv:
        if not kv_agent.config.is_consumer:
            raise ApiError(400, f"a transfer needs a kv_consumer or kv_both instance; this one is "
                                f"{kv_agent.config.kv_role}", param="kv_transfer_params")
    else:
        raise ApiError(400, "kv_transfer_params must hold do_remote_decode=true (for a producer) or a producer's "
                            "returned parameters (for a consumer)", param="kv_transfer_params")


@dataclass(frozen=True)
class ServerOptions:
    """What the server does beyond serving the model (``dcpgraph serve``'s flags of the same names)."""

    chat_template: str | None = None  # a Jinja template used instead of the tokenizer's
    max_logprobs: int = MAX_LOGPROBS  # the most log-probabilities a request may ask for per token
    log_stats: bool = True  # log the engine's state every STATS_EVERY_S (vLLM's --disable-log-stats turns it off)
    log_requests: bool = False  # log each request's sampling parameters and prompt ids (--enable-log-requests)
    reasoning_parser: str | None = None  # --reasoning-parser: qwen3 / deepseek_r1 (serving/reasoning.py)
    auto_tool_parser: str | None = None  # --tool-call-parser with --enable-auto-tool-choice (serving/tool_parsers.py)


def build_app(llm, *, served_model_name: str, api_key: str | None = None, max_body_bytes: int = 1 << 28,
              kv_agent=None, options: ServerOptions | None = None) -> FastAPI:
    """``kv_agent``: this instance's P/D side (:class:`~.kv_connector.agent.KVAgent`), if any."""
    server = OpenAIServer(llm, served_model_name=served_model_name, api_key=api_key, max_body_bytes=max_body_bytes,
                          kv_agent=kv_agent, options=options or ServerOptions())
    app = FastAPI(title="dcpgraph", lifespan=server.lifespan)
    app.state.engine_loop = server.engine_loop
    app.state.server = server
    app.exception_handler(ApiError)(_api_error)
    app.add_middleware(Authenticate, server=server)
    app.add_middleware(CountInFlight, server=server)
    app.post("/v1/completions")(server.completions)
    app.post("/v1/chat/completions")(server.chat_completions)
    app.get("/v1/models")(server.models)
    app.get("/health")(server.health)
    app.get("/ping")(server.health)
    app.post("/ping")(server.health)
    app.get("/version")(server.version)
    app.get("/load")(server.load)
    app.post("/tokenize")(server.tokenize)
    app.post("/detokenize")(server.detokenize)
    app.post("/reset_prefix_cache")(server.reset_prefix_cache)
    app.get("/kv_transfer/stats")(server.kv_transfer_stats)
    app.get("/metrics")(server.prometheus)
    return app


async def _api_error(request: Request, err: ApiError):
    return JSONResponse(error_body(err.status, err.message, err.kind, err.param), status_code=err.status)


class OpenAIServer:
    """The state behind the routes (the LLM, its engine loop, metrics, the P/D agent) and one
    handler per route; :func:`build_app` registers them."""

    def __init__(self, llm, *, served_model_name: str, api_key: str | None, max_body_bytes: int, kv_agent,
                 options: ServerOptions):
        self.llm, self.served_model_name, self.kv_agent = llm, served_model_name, kv_agent
        self.api_key, self.max_body_bytes, self.options = api_key, max_body_bytes, options
        self.chat_template = options.chat_template
        self.in_flight = 0  # completion and chat requests being answered (CountInFlight)
        self.generated = 0  # tokens sent to clients (for the stats line)
        self.sampling_defaults = generation_defaults(llm.settings.model.model, llm.settings.serving.generation_config)
        kv_sizing = llm.engine.memory_report().get("kv_sizing")
        self.metrics = Metrics(served_model_name, cache_config_info(llm.settings, llm.num_kv_blocks(), kv_sizing),
                               max_model_len=llm.max_model_len, engines=llm.engine.engine_count)
        self.engine_loop = EngineLoop(llm, self.metrics, kv_agent)
        parser = options.reasoning_parser
        self.reasoning = ReasoningParser.for_tokenizer(parser, llm.tokenizer) if parser else None

    @contextlib.asynccontextmanager
    async def lifespan(self, app: FastAPI):
        stats = asyncio.ensure_future(self.log_stats()) if self.options.log_stats else None
        yield
        if stats is not None:
            stats.cancel()
        self.engine_loop.stop()
        self.llm.shutdown()

    async def log_stats(self) -> None:
        """Every :data:`STATS_EVERY_S` while the engine has (or just had) work: requests running
        and waiting, KV cache use per rank, generated tokens per second (vLLM's periodic line)."""
        busy_before, tokens_before = False, self.generated
        while True:
            await asyncio.sleep(STATS_EVERY_S)
            snap = self.engine_loop.snapshot()
            busy = bool(snap["running"] or snap["waiting"] or self.in_flight)
            if busy or busy_before:
                rate = (self.generated - tokens_before) / STATS_EVERY_S
                log.info("engine: %d running, %d waiting, %d HTTP request(s) in flight, KV cache use per rank %s, "
                         "%.1f generated tokens/s", snap["running"], snap["waiting"], self.in_flight,
                         [f"{100 * u:.1f}%" for u in snap["kv_usage"]], rate)
            busy_before, tokens_before = busy, self.generated

    # -- routes ---------------------------------------------------------------------------------

    async def completions(self, request: Request):
        log_id = f"cmpl-{request_id(request)}"
        body = self.parse(CompletionRequest, await self.read_json(request))
        try:
            prompts = [encode_prompt(self.llm.tokenizer, p, add_special_tokens=body.add_special_tokens)
                       for p in body.prompts()]
        except TypeError as err:
            raise ApiError(400, str(err), param="prompt") from None
        return await self.respond(request, prompts, body, body.engine_max_tokens(), log_id, chat=False)

    async def chat_completions(self, request: Request):
        log_id = f"chatcmpl-{request_id(request)}"
        body = self.parse(ChatCompletionRequest, await self.read_json(request))
        if body.tool_choice == "auto" and self.options.auto_tool_parser is None:
            raise ApiError(400, AUTO_NEEDS_PARSER, param="tool_choice")
        prompt = self.render_chat(body)
        return await self.respond(request, [prompt], body, body.limit(), log_id, chat=True)

    def render_chat(self, body) -> Prompt:
        """``body.messages`` through the chat template (the server's ``--chat-template`` if given),
        with the request's template keywords; a template that fails on them is a 400."""
        messages = [m.for_template() for m in body.messages]
        try:
            return chat_prompt(self.llm.tokenizer, messages, chat_template=self.chat_template,
                               **body.template_kwargs())
        except Exception as err:  # the template's own errors (jinja2's TemplateError, ValueError, ...)
            raise ApiError(400, f"the chat template failed: {type(err).__name__}: {err}", param="messages") from None

    async def tokenize(self, request: Request):
        """vLLM's ``/tokenize``: a ``prompt`` (completions form) or ``messages`` (chat form)."""
        data = await self.read_json(request)
        body = self.parse(TokenizeChatRequest if "messages" in data else TokenizeCompletionRequest, data)
        prompt = self.render_chat(body) if "messages" in data else None
        return tokenize_request(self.llm.tokenizer, body, prompt, self.llm.max_model_len)

    async def detokenize(self, request: Request):
        """vLLM's ``/detokenize``: ``{"tokens": [...]}`` -> ``{"prompt": text}``."""
        body = self.parse(DetokenizeRequest, await self.read_json(request))
        vocab = self.llm.info.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise ApiError(400, f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})", param="tokens")
        return {"prompt": self.llm.tokenizer.decode(body.tokens)}

    async def version(self):
        """The installed distribution's version (vLLM's route answers its own)."""
        from importlib.metadata import PackageNotFoundError, version

        try:
            return {"version": version("dcpgraph")}
        except PackageNotFoundError:  # run from a source tree that was never installed
            return {"version": "unknown"}

    async def load(self):
        return {"server_load": self.in_flight}

    async def reset_prefix_cache(self):
        """Forget every cached prefix on every rank (vLLM's route; 200 on success)."""
        try:
            freed = await self.engine_loop.call(lambda engine: engine.rank_call("reset_prefix_cache", {}))
        except EngineDeadError as err:
            raise ApiError(503, str(err), "service_unavailable") from None
        log.info("prefix cache reset: %s cached-free block(s) freed per rank", freed[0])
        return {"freed_blocks": freed[0]}

    async def models(self):
        return {"object": "list", "data": [{"id": self.served_model_name, "object": "model", "created": 0,
                                            "owned_by": "dcpgraph", "max_model_len": self.llm.max_model_len}]}

    async def health(self):
        if self.engine_loop.healthy:
            return Response(status_code=200)
        reason = self.engine_loop.error or "a worker process is not running"
        return JSONResponse(error_body(503, reason, "service_unavailable"), status_code=503)

    async def kv_transfer_stats(self):
        """P/D counters; ``prompt_tokens_computed``: prompt tokens this instance's ranks ran (every
        data-parallel replica's)."""
        snap = self.engine_loop.snapshot()
        counts = [e["prefix_cache"].get("prompt_tokens_computed") for e in snap["engines"]]
        counts = counts or [snap["prefix_cache"].get("prompt_tokens_computed")]
        computed = None if None in counts else sum(counts)
        return {**(self.kv_agent.stats if self.kv_agent else {"role": None}), "prompt_tokens_computed": computed}

    async def prometheus(self):
        return Response(self.metrics.render(self.engine_loop.snapshot()), media_type=CONTENT_TYPE)

    # -- request handling -----------------------------------------------------------------------

    async def read_json(self, request: Request) -> dict:
        """The body as a JSON object, read at most ``max_body_bytes`` (413 past it, 400 if malformed)."""
        limit = self.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise ApiError(413, f"request body of {declared} bytes exceeds {limit}")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise ApiError(413, f"request body exceeds {limit} bytes")
        try:
            data = json.loads(body)
        except ValueError as err:
            raise ApiError(400, f"malformed JSON body: {err}") from None
        if not isinstance(data, dict):
            raise ApiError(400, "the JSON body must be an object")
        return data

    def parse(self, model_cls, data: dict):
        try:
            parsed = model_cls.model_validate(data)
        except ValidationError as err:
            first = err.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            msg = first["msg"].removeprefix("Value error, ")
            raise ApiError(400, f"{where}: {msg}" if where else msg, param=where or None) from None
        if parsed.model is not None and parsed.model != self.served_model_name:
            raise ApiError(404, f"model {parsed.model!r} does not exist; this server serves "
                                f"{self.served_model_name!r}", "not_found_error", "model")
        return parsed

    def sampling_params(self, body, limit: int | None):
        """The request's :class:`SamplingParams`, its ``bad_words`` tokenized, every token id it
        names checked against the model's vocabulary (400 otherwise)."""
        try:
            given = {k for k in body.model_fields_set if getattr(body, k) is not None}
            params = with_defaults(body.sampling_params(limit), given, self.sampling_defaults)
            params.update_from_tokenizer(self.llm.tokenizer)
            params.check_vocab(self.llm.info.vocab_size)
        except ValueError as err:
            raise ApiError(400, str(err)) from None
        parser = self.reasoning
        if (parser is not None and isinstance(body, ChatCompletionRequest) and params.structured_outputs is not None
                and parser.end_token_id is not None and parser.thinks(body.chat_template_kwargs)):
            params.structured_outputs_after_token = parser.end_token_id  # as vLLM: constrain what follows </think>
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(params, name)
            if asked is not None and asked > self.options.max_logprobs:
                raise ApiError(400, f"{asked} {name.replace('_', ' ')} per token asked; this server returns at most "
                                    f"{self.options.max_logprobs} (--max-logprobs)", param=name)
        return params

    def check_lengths(self, prompts: list[Prompt], limit: int | None) -> None:
        """Every prompt is shorter than ``max_model_len``, and leaves room for ``limit`` new tokens."""
        max_model_len = self.llm.max_model_len
        for p in prompts:
            if len(p.token_ids) >= max_model_len:
                raise ApiError(400, f"the prompt has {len(p.token_ids)} tokens; max_model_len is {max_model_len}",
                               param="prompt")
            if limit is not None and len(p.token_ids) + limit > max_model_len:
                raise ApiError(400, f"prompt ({len(p.token_ids)} tokens) + max_tokens ({limit}) exceeds "
                                    f"max_model_len={max_model_len}", param="max_tokens")

    async def submit(self, prompts: list[Prompt], body, limit: int | None, log_id: str):
        """Queue every choice (choice ``i·n + j`` is prompt ``i``'s ``j``-th sample); returns
        ``(out queue, [(rid, choice)])``. A refusal aborts the choices already queued."""
        params = self.sampling_params(body, limit)
        if params.structured_outputs is not None:  # compiled on the engine thread: 400 if it cannot be
            try:
                await self.engine_loop.call(lambda _engine: self.llm.prepare_structured_outputs(params))
            except ValueError as err:
                raise ApiError(400, str(err), param="structured_outputs") from None
        prompts[:] = [truncated(p, params, self.llm.max_model_len) for p in prompts]
        log.debug("request %s: sampling %s", log_id, params)
        self.check_lengths(prompts, limit)
        kv = body.kv_transfer_params
        if kv is not None:
            check_kv_transfer(self.kv_agent, kv, prompts, params, body.stream)
        out: asyncio.Queue = asyncio.Queue()
        submitted = []
        try:
            for i, p in enumerate(prompts):
                max_tokens = self.llm.max_tokens_for(params, len(p.token_ids))
                for j in range(params.n):
                    choice = i * params.n + j
                    rid = await self.engine_loop.submit(p.token_ids, params, max_tokens, j, choice, out, log_id, kv)
                    submitted.append((rid, choice))
        except (RequestError, ValueError, EngineDeadError, KVTransferError) as err:
            for rid, _ in submitted:
                self.engine_loop.abort(rid)
            raise ApiError(status_for(err), str(err), "service_unavailable" if status_for(err) >= 500 else
                           "invalid_request_error") from None
        log.info("request %s: %d prompt(s), %d choice(s), prompt tokens %s", log_id, len(prompts),
                 len(submitted), [len(p.token_ids) for p in prompts])
        if self.options.log_requests:
            log.info("request %s: %s, prompt token ids %s", log_id, params,
                     [p.token_ids[:LOG_PROMPT_IDS] + (["..."] if len(p.token_ids) > LOG_PROMPT_IDS else [])
                      for p in prompts])
        return out, submitted

    def _parent_done(self, prompt: int, n: int, open_choices: dict, generated: dict, engines: dict) -> None:
        """Report prompt ``prompt``'s request (choices ``prompt·n`` to ``prompt·n + n − 1``, vLLM's
        parent request) to the metrics once all its choices have finished, under the engine of its
        first choice."""
        group = range(prompt * n, prompt * n + n)
        if not any(c in open_choices for c in group):
            self.metrics.parent_done(n, max(generated[c] for c in group), engines.get(group[0], 0))

    async def pieces(self, out: asyncio.Queue, submitted: list, log_id: str, n: int = 1):
        """Every piece of every choice until all finish; aborts what is left if the consumer stops."""
        open_choices = {choice: rid for rid, choice in submitted}
        generated = dict.fromkeys(open_choices, 0)
        engines: dict[int, int] = {}  # choice -> the engine running it
        try:
            while open_choices:
                piece: Piece = await out.get()
                if piece.error is not None:
                    open_choices.clear()
                    raise ApiError(503, f"the engine failed: {piece.error}", "service_unavailable")
                generated[piece.choice] += len(piece.token_ids)
                engines[piece.choice] = piece.engine
                if piece.finished:
                    open_choices.pop(piece.choice, None)
                    self._parent_done(piece.choice // n, n, open_choices, generated, engines)
                yield piece
        finally:
            for rid in open_choices.values():
                self.engine_loop.abort(rid)
            if open_choices:
                log.info("request %s: client went away, %d choice(s) aborted", log_id, len(open_choices))

    async def respond(self, request: Request, prompts: list[Prompt], body, limit, log_id: str, chat: bool):
        """Submit the request, then answer with one JSON body or, with ``stream``, server-sent events."""
        out, submitted = await self.submit(prompts, body, limit, log_id)
        reply = Reply(self, prompts, body, log_id, chat, [c for _, c in submitted])
        headers = {"X-Request-Id": log_id}
        if not body.stream:
            whole = await _unless_disconnected(request, reply.whole(self.pieces(out, submitted, log_id, body.n)))
            return JSONResponse(whole, headers=headers) if whole is not None else Response(status_code=499)
        return StreamingResponse(reply.events(self.pieces(out, submitted, log_id, body.n)),
                                 media_type="text/event-stream",
                                 headers=headers)


def request_id(request: Request) -> str:
    """The client's ``X-Request-Id`` header if it sent one (as vLLM, so the client's and the
    server's logs name a request alike), else a fresh random id."""
    given = request.headers.get("x-request-id", "").strip()
    return given[:MAX_REQUEST_ID] if given else uuid.uuid4().hex


async def _unless_disconnected(request: Request, work):
    """``await work``, unless the client disconnects first: then ``work`` is cancelled (the
    pieces generator it iterates aborts the request's choices) and ``None`` is returned."""
    task = asyncio.ensure_future(work)
    while True:
        done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return None
