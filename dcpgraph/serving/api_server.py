"""The OpenAI-compatible HTTP API on FastAPI: ``/v1/models``, ``/v1/completions``,
``/v1/chat/completions`` (``stream`` as server-sent events or one JSON body), ``/health``, ``/metrics``.

Every request gets an id (``cmpl-…`` / ``chatcmpl-…``) that its log lines and its
``X-Request-Id`` header carry. Bodies are read with a size bound before JSON parsing (413 past it),
then validated strictly (:mod:`.protocol`); every refusal is OpenAI's error shape
``{"error": {"message", "type", "param", "code"}}``: 400 for bad input (malformed JSON, unknown
fields, invalid sampling values, a prompt or ``max_tokens`` past ``max_model_len``), 401 for a
missing or wrong API key on ``/v1`` routes, 404 for an unknown model name, 503 once the engine has
failed. Engine errors map by class (:func:`status_for`): any ``RequestError`` is a 400 unless its
class (or a base) is listed in :data:`STATUS_BY_ERROR_NAME` (a queue-full error is a 429) or
defines ``http_status``. A client that goes away mid-stream has its requests aborted at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import ValidationError

from ..errors import KVTransferError, RequestError
from .engine_loop import EngineDeadError, EngineLoop, Piece
from .logprobs import chat_logprobs, completion_logprobs
from .metrics import Metrics, cache_config_info
from .prompts import Prompt, chat_prompt, encode_prompt
from .protocol import ChatCompletionRequest, CompletionRequest

log = logging.getLogger("dcpgraph.serving")
STATUS_BY_ERROR_NAME = {"QueueFullError": 429, "EngineDeadError": 503, "WorkerDiedError": 503}


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


def status_for(err: BaseException) -> int:
    """HTTP status of an engine-side error, by class: ``http_status`` if the class defines one,
    else the first of its classes named in :data:`STATUS_BY_ERROR_NAME`, else 400 for request errors."""
    explicit = getattr(err, "http_status", None)
    if isinstance(explicit, int):
        return explicit
    for cls in type(err).__mro__:
        if cls.__name__ in STATUS_BY_ERROR_NAME:
            return STATUS_BY_ERROR_NAME[cls.__name__]
    return 400 if isinstance(err, (RequestError, ValueError)) else 500


def error_body(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


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


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def build_app(llm, *, served_model_name: str, api_key: str | None = None, max_body_bytes: int = 1 << 20,
              kv_agent=None) -> FastAPI:
    """``kv_agent``: this instance's P/D side (:class:`~.kv_connector.agent.KVAgent`), if any."""
    metrics = Metrics(served_model_name, cache_config_info(llm.config, llm.num_kv_blocks()))
    engine_loop = EngineLoop(llm, metrics, kv_agent)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        engine_loop.stop()
        llm.shutdown()

    app = FastAPI(title="dcpgraph", lifespan=lifespan)
    app.state.engine_loop = engine_loop

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, err: ApiError):
        return JSONResponse(error_body(err.status, err.message, err.kind, err.param), status_code=err.status)

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if api_key and request.url.path.startswith("/v1"):
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return JSONResponse(error_body(401, "invalid or missing API key", "authentication_error"),
                                    status_code=401)
        return await call_next(request)

    async def read_json(request: Request) -> dict:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
            raise ApiError(413, f"request body of {declared} bytes exceeds {max_body_bytes}")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > max_body_bytes:
                raise ApiError(413, f"request body exceeds {max_body_bytes} bytes")
        try:
            data = json.loads(body)
        except ValueError as err:
            raise ApiError(400, f"malformed JSON body: {err}") from None
        if not isinstance(data, dict):
            raise ApiError(400, "the JSON body must be an object")
        return data

    def parse(model_cls, data: dict):
        try:
            parsed = model_cls.model_validate(data)
        except ValidationError as err:
            first = err.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise ApiError(400, f"{where}: {first['msg']}" if where else first["msg"], param=where or None) from None
        if parsed.model is not None and parsed.model != served_model_name:
            raise ApiError(404, f"model {parsed.model!r} does not exist; this server serves {served_model_name!r}",
                           "not_found_error", "model")
        if getattr(parsed, "best_of", None) not in (None, parsed.n):
            raise ApiError(400, "best_of must equal n", param="best_of")
        return parsed

    async def submit(prompts: list[Prompt], body, limit: int | None, log_id: str):
        """Queue every choice; returns ``(params, out queue, [(rid, choice)], prompt token counts)``."""
        try:
            params = body.sampling_params(limit)
        except ValueError as err:
            raise ApiError(400, str(err)) from None
        for p in prompts:
            if len(p.token_ids) >= llm.max_model_len:
                raise ApiError(400, f"the prompt has {len(p.token_ids)} tokens; max_model_len is {llm.max_model_len}",
                               param="prompt")
            if limit is not None and len(p.token_ids) + limit > llm.max_model_len:
                raise ApiError(400, f"prompt ({len(p.token_ids)} tokens) + max_tokens ({limit}) exceeds "
                                    f"max_model_len={llm.max_model_len}", param="max_tokens")
        kv = body.kv_transfer_params
        if kv is not None:
            check_kv_transfer(kv_agent, kv, prompts, params, body.stream)
        out: asyncio.Queue = asyncio.Queue()
        submitted = []
        try:
            for i, p in enumerate(prompts):
                max_tokens = llm.max_tokens_for(params, len(p.token_ids))
                for j in range(params.n):
                    choice = i * params.n + j
                    rid = await engine_loop.submit(p.token_ids, params, max_tokens, j, choice, out, log_id, kv)
                    submitted.append((rid, choice))
        except (RequestError, ValueError, EngineDeadError, KVTransferError) as err:
            for rid, _ in submitted:
                engine_loop.abort(rid)
            raise ApiError(status_for(err), str(err), "service_unavailable" if status_for(err) >= 500 else
                           "invalid_request_error") from None
        log.info("request %s: %d prompt(s), %d choice(s), prompt tokens %s", log_id, len(prompts),
                 len(submitted), [len(p.token_ids) for p in prompts])
        return out, submitted

    async def pieces(out: asyncio.Queue, submitted: list, log_id: str):
        """Every piece of every choice until all finish; aborts what is left if the consumer stops."""
        open_choices = {choice: rid for rid, choice in submitted}
        try:
            while open_choices:
                piece: Piece = await out.get()
                if piece.error is not None:
                    open_choices.clear()
                    raise ApiError(503, f"the engine failed: {piece.error}", "service_unavailable")
                if piece.finished:
                    open_choices.pop(piece.choice, None)
                yield piece
        finally:
            for rid in open_choices.values():
                engine_loop.abort(rid)
            if open_choices:
                log.info("request %s: client went away, %d choice(s) aborted", log_id, len(open_choices))

    def usage(prompts: list[Prompt], n: int, generated: int) -> dict:
        prompt_tokens = sum(len(p.token_ids) for p in prompts) * n
        return {"prompt_tokens": prompt_tokens, "completion_tokens": generated,
                "total_tokens": prompt_tokens + generated}

    async def respond(request: Request, prompts: list[Prompt], body, limit, log_id: str, chat: bool):
        out, submitted = await submit(prompts, body, limit, log_id)
        created = int(time.time())
        kind = "chat.completion" if chat else "text_completion"
        headers = {"X-Request-Id": log_id}
        wants_logprobs = body.requested_logprobs() is not None
        offsets = {c: 0 for _, c in submitted}  # completions' text_offset, per choice

        def logprobs_of(choice: int, token_ids: list[int], entries: list[dict]) -> dict | None:
            if not wants_logprobs:
                return None
            if chat:
                return chat_logprobs(llm.tokenizer, token_ids, entries)
            value, offsets[choice] = completion_logprobs(llm.tokenizer, token_ids, entries, offsets[choice])
            return value

        if not body.stream:
            texts = {c: "" for _, c in submitted}
            tokens: dict[int, tuple[list[int], list[dict]]] = {c: ([], []) for c in texts}
            reasons: dict[int, str | None] = {}
            generated = 0
            handover = None
            async for piece in pieces(out, submitted, log_id):
                texts[piece.choice] += piece.text
                tokens[piece.choice][0].extend(piece.token_ids)
                tokens[piece.choice][1].extend(piece.logprobs)
                generated += len(piece.token_ids)
                handover = piece.kv_transfer_params or handover
                if piece.finished:
                    reasons[piece.choice] = piece.finish_reason
            choices = [
                {"index": c, "message": {"role": "assistant", "content": texts[c]},
                 "logprobs": logprobs_of(c, *tokens[c]), "finish_reason": reasons[c]} if chat else
                {"index": c, "text": texts[c], "logprobs": logprobs_of(c, *tokens[c]), "finish_reason": reasons[c]}
                for c in sorted(texts)
            ]
            return JSONResponse({"id": log_id, "object": kind, "created": created, "model": served_model_name,
                                 "choices": choices, "usage": usage(prompts, body.n, generated),
                                 **({"kv_transfer_params": handover} if handover else {})}, headers=headers)

        chunk_kind = "chat.completion.chunk" if chat else "text_completion"
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        def chunk(choices: list[dict], **extra) -> dict:
            return {"id": log_id, "object": chunk_kind, "created": created, "model": served_model_name,
                    "choices": choices, **extra}

        async def events():
            generated = 0
            try:
                if chat:
                    yield _sse(chunk([{"index": c, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                       "finish_reason": None} for _, c in submitted]))
                async for piece in pieces(out, submitted, log_id):
                    generated += len(piece.token_ids)
                    logprobs = logprobs_of(piece.choice, piece.token_ids, piece.logprobs)
                    if chat:
                        delta = {"content": piece.text} if piece.text or not piece.finished else {}
                        choice = {"index": piece.choice, "delta": delta, "logprobs": logprobs,
                                  "finish_reason": piece.finish_reason}
                    else:
                        choice = {"index": piece.choice, "text": piece.text, "logprobs": logprobs,
                                  "finish_reason": piece.finish_reason}
                    yield _sse(chunk([choice]))
                if include_usage:
                    yield _sse(chunk([], usage=usage(prompts, body.n, generated)))
                yield _sse("[DONE]")
            except ApiError as err:
                log.error("request %s: %s", log_id, err.message)
                yield _sse(error_body(err.status, err.message, err.kind))

        return StreamingResponse(events(), media_type="text/event-stream", headers=headers)

    @app.post("/v1/completions")
    async def completions(request: Request):
        log_id = f"cmpl-{uuid.uuid4().hex}"
        body = parse(CompletionRequest, await read_json(request))
        try:
            prompts = [encode_prompt(llm.tokenizer, p) for p in body.prompts()]
        except TypeError as err:
            raise ApiError(400, str(err), param="prompt") from None
        return await respond(request, prompts, body, body.max_tokens, log_id, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        log_id = f"chatcmpl-{uuid.uuid4().hex}"
        body = parse(ChatCompletionRequest, await read_json(request))
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        try:
            prompt = chat_prompt(llm.tokenizer, messages)
        except ValueError as err:
            raise ApiError(400, str(err), param="messages") from None
        return await respond(request, [prompt], body, body.limit(), log_id, chat=True)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served_model_name, "object": "model", "created": 0,
                                            "owned_by": "dcpgraph", "max_model_len": llm.max_model_len}]}

    @app.get("/health")
    async def health():
        if engine_loop.healthy:
            return Response(status_code=200)
        reason = engine_loop.error or "a worker process is not running"
        return JSONResponse(error_body(503, reason, "service_unavailable"), status_code=503)

    @app.get("/kv_transfer/stats")
    async def kv_transfer_stats():
        """P/D counters; ``prompt_tokens_computed``: prompt tokens this instance's ranks ran."""
        computed = engine_loop.snapshot()["prefix_cache"].get("prompt_tokens_computed")
        return {**(kv_agent.stats if kv_agent else {"role": None}), "prompt_tokens_computed": computed}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(engine_loop.snapshot()), media_type="text/plain; version=0.0.4")

    return app
