"""The order and contents of a streamed answer's server-sent events (:class:`_Reply.events`),
driven by hand-made engine pieces, without a server or a model."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from dcpgraph.serving.engine_loop import Piece
from dcpgraph.serving.prompts import Prompt
from dcpgraph.serving.protocol import ChatCompletionRequest
from dcpgraph.serving.responses import Reply as _Reply


def reply(**body) -> _Reply:
    server = SimpleNamespace(served_model_name="m", generated=0, llm=SimpleNamespace(tokenizer=None))
    request = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], **body})
    return _Reply(server, [Prompt("x", [1, 2, 3])], request, "chatcmpl-1", chat=True, choices=[0])


def test_the_chat_role_chunk_waits_for_the_first_token():
    """vLLM sends the ``role`` chunk with the first token; sent at arrival, it would let a client
    that times its first chunk (``vllm bench serve``) report a TTFT with no prefill in it."""

    async def run():
        first_token = asyncio.Event()

        async def pieces():
            await first_token.wait()
            yield Piece(choice=0, text="a", token_ids=[7])
            yield Piece(choice=0, text="b", token_ids=[8], finished=True, finish_reason="length")

        events = reply(stream=True).events(pieces())
        first = asyncio.ensure_future(events.__anext__())
        await asyncio.sleep(0.05)
        assert not first.done(), "an event was sent before the engine produced a token"
        first_token.set()
        return [await first] + [e async for e in events]

    events = asyncio.run(asyncio.wait_for(run(), 10))
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert [c["choices"][0]["delta"] for c in chunks] == [{"role": "assistant", "content": ""}, {"content": "a"},
                                                          {"content": "b"}]
    assert events[-1] == "data: [DONE]\n\n" and all("usage" not in c for c in chunks)


def test_continuous_usage_counts_each_choices_tokens_so_far():
    async def run(r):
        async def pieces():
            yield Piece(choice=0, text="ab", token_ids=[7, 8])
            yield Piece(choice=0, text="c", token_ids=[9], finished=True, finish_reason="length")

        return [json.loads(e.removeprefix("data: ")) for e in [e async for e in r.events(pieces())][:-1]]

    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = asyncio.run(run(reply(stream=True, stream_options=options)))
    assert [c["usage"]["completion_tokens"] for c in chunks] == [0, 2, 3, 3]
    assert {c["usage"]["prompt_tokens"] for c in chunks} == {3} and chunks[-1]["choices"] == []
    chunks = asyncio.run(run(reply(stream=True, stream_options={"include_usage": True})))
    assert ["usage" in c for c in chunks] == [False, False, False, True]
