"""``dcpgraph proxy --prefill URL --decode URL --port N``: the OpenAI-compatible front door of a
prefill/decode pair (several of each, taken round robin).

Each ``/v1/completions`` or ``/v1/chat/completions`` request goes first to a prefill instance
(``kv_producer``) as ``max_tokens=1, stream=false`` with ``kv_transfer_params:
{"do_remote_decode": true}``; its response carries the parameters of the held KV, and the original
request goes with them to a decode instance (``kv_consumer``), whose response (streamed or not,
starting with the producer's token) is relayed as is. A request that ends at its first token
(an EOS or a stop) never reaches a decode instance, nor does one with ``max_tokens=1``.

Failures are OpenAI-shaped errors naming the instance: an unreachable instance is skipped for the
next one of its kind (nothing was sent to it); an instance that fails after accepting (502), or a
decode instance whose transfer failed (its own 503, relayed), ends the request. Every call is
bounded by ``--timeout-s``.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import logging
import sys

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from .api_errors import error_body

log = logging.getLogger("dcpgraph.proxy")


class _Failed(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message

    def response(self) -> JSONResponse:
        kind = "service_unavailable" if self.status >= 500 else "invalid_request_error"
        return JSONResponse(error_body(self.status, self.message, kind), status_code=self.status)


class _Pool:
    """Round robin over instances of one kind; :meth:`order` is the next start and the rest."""

    def __init__(self, kind: str, urls: list[str]):
        self.kind, self.urls = kind, [u.rstrip("/") for u in urls]
        self._next = itertools.count()

    def order(self) -> list[str]:
        start = next(self._next) % len(self.urls)
        return self.urls[start:] + self.urls[:start]


def _relayed_error(kind: str, url: str, response: httpx.Response) -> _Failed:
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text[:500]
    return _Failed(response.status_code, f"{kind} instance {url}: {message}")


def build_proxy_app(prefill: list[str], decode: list[str], *, timeout_s: float = 300.0) -> FastAPI:
    if not prefill or not decode:
        raise ValueError("the proxy needs at least one --prefill and one --decode URL")
    proxy = _Proxy(prefill, decode, timeout_s)
    app = FastAPI(title="dcpgraph proxy", lifespan=proxy.lifespan)
    app.post("/v1/completions")(proxy.completions)
    app.post("/v1/chat/completions")(proxy.chat_completions)
    app.get("/v1/models")(proxy.models)
    app.get("/health")(proxy.health)
    return app


def _auth_headers(request: Request) -> dict:
    return {k: v for k, v in request.headers.items() if k.lower() == "authorization"}


class _Proxy:
    """The prefill and decode pools, one HTTP client, and one handler per route."""

    def __init__(self, prefill: list[str], decode: list[str], timeout_s: float):
        self.pools = {"prefill": _Pool("prefill", prefill), "decode": _Pool("decode", decode)}
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=5.0))

    @contextlib.asynccontextmanager
    async def lifespan(self, app: FastAPI):
        yield
        await self.client.aclose()

    async def completions(self, request: Request):
        return await self.route(request, "/v1/completions", chat=False)

    async def chat_completions(self, request: Request):
        return await self.route(request, "/v1/chat/completions", chat=True)

    async def models(self, request: Request):
        headers = _auth_headers(request)
        for url in self.pools["decode"].order():
            try:
                response = await self.client.get(url + "/v1/models", headers=headers)
                return JSONResponse(response.json(), status_code=response.status_code)
            except httpx.HTTPError:
                continue
        return _Failed(502, "no decode instance reachable").response()

    async def health(self):
        return {"prefill": self.pools["prefill"].urls, "decode": self.pools["decode"].urls}

    async def send(self, kind: str, path: str, body: dict, headers: dict, stream: bool = False):
        """``(url, response)`` from the first reachable instance of ``kind``."""
        unreachable = []
        for url in self.pools[kind].order():
            request = self.client.build_request("POST", url + path, json=body, headers=headers)
            try:
                return url, await self.client.send(request, stream=stream)
            except httpx.ConnectError as err:
                unreachable.append(f"{url} ({err})")
                log.warning("%s instance %s unreachable, trying the next", kind, url)
            except httpx.HTTPError as err:
                raise _Failed(502, f"{kind} instance {url} failed after accepting the request: "
                                   f"{type(err).__name__}: {err}") from None
        raise _Failed(502, f"no {kind} instance reachable: {'; '.join(unreachable)}")

    async def route(self, request: Request, path: str, chat: bool):
        """Check the body, then prefill and decode it; a failure is answered in OpenAI's error shape."""
        try:
            body = json.loads(await request.body())
        except ValueError as err:
            return _Failed(400, f"malformed JSON body: {err}").response()
        if not isinstance(body, dict):
            return _Failed(400, "the JSON body must be an object").response()
        if body.get("n", 1) != 1 or "kv_transfer_params" in body:
            return _Failed(400, "through the P/D proxy: n must be 1 and kv_transfer_params is set by the proxy").response()
        try:
            return await self.prefill_then_decode(body, path, _auth_headers(request), chat)
        except _Failed as err:
            log.error("%s", err.message)
            return err.response()

    async def prefill_then_decode(self, body: dict, path: str, headers: dict, chat: bool):
        """The prefill instance computes the first token and hands its KV over; the decode instance
        continues from it. A request for one token, or one that ends at its first, is prefill's alone."""
        stream = bool(body.get("stream"))
        limit = body.get("max_completion_tokens", body.get("max_tokens")) if chat else body.get("max_tokens", 16)
        if limit == 1:  # nothing to decode: the prefill instance answers alone
            url, response = await self.send("prefill", path, body, headers, stream=stream)
            return await _relay("prefill", url, response, stream)
        first = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "max_completion_tokens")}
        first.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
        url, response = await self.send("prefill", path, first, headers)
        if response.status_code != 200:
            raise _relayed_error("prefill", url, response)
        data = response.json()
        kv = data.pop("kv_transfer_params", None)
        if not kv:  # ended at its first token
            return _as_stream(data, chat) if stream else JSONResponse(data)
        url, response = await self.send("decode", path, {**body, "kv_transfer_params": kv}, headers, stream=stream)
        return await _relay("decode", url, response, stream)


async def _relay(kind: str, url: str, response: httpx.Response, stream: bool):
    if not stream:
        if response.status_code != 200:
            raise _relayed_error(kind, url, response)
        return JSONResponse(response.json())
    if response.status_code != 200:
        await response.aread()
        await response.aclose()
        raise _relayed_error(kind, url, response)

    async def lines():
        try:
            async for chunk in response.aiter_raw():
                yield chunk
        except httpx.HTTPError as err:
            message = f"{kind} instance {url} failed mid-stream: {type(err).__name__}: {err}"
            log.error("%s", message)
            yield f"data: {json.dumps(error_body(502, message, 'service_unavailable'))}\n\n".encode()
        finally:
            await response.aclose()

    return StreamingResponse(lines(), media_type="text/event-stream")


def _as_stream(data: dict, chat: bool) -> StreamingResponse:
    """A finished non-streamed response as server-sent events (one chunk, then ``[DONE]``)."""
    choices = []
    for c in data["choices"]:
        if chat:
            choices.append({"index": c["index"], "delta": {"role": "assistant", "content": c["message"]["content"]},
                            "logprobs": None, "finish_reason": c["finish_reason"]})
        else:
            choices.append({**c})
    chunk = {**data, "object": "chat.completion.chunk" if chat else "text_completion", "choices": choices}
    chunk.pop("usage", None)

    async def events():
        yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dcpgraph proxy", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefill", action="append", required=True, help="a prefill (kv_producer) instance's URL; repeat")
    p.add_argument("--decode", action="append", required=True, help="a decode (kv_consumer) instance's URL; repeat")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--timeout-s", type=float, default=300.0, help="bound on every call to an instance")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import uvicorn

    bad = [u for u in args.prefill + args.decode if not u.startswith(("http://", "https://"))]
    if bad:
        print(f"dcpgraph proxy: URLs must start with http:// or https://: {bad}", file=sys.stderr)
        return 2
    app = build_proxy_app(args.prefill, args.decode, timeout_s=args.timeout_s)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
    return 0
