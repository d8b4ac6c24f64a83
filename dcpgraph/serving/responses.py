"""One request's answer in OpenAI's shapes: a ``chat.completion`` / ``text_completion`` body, or
its server-sent-event chunks, with logprobs in the chat or the completions format.

Echo (completions, vLLM's): a choice's first piece is shown with its prompt in front (text, token
ids and, with ``logprobs``, the prompt tokens' entries, the first one ``null``); with
``max_tokens: 0`` the prompt alone replaces the one token the engine ran. ``prompt_logprobs``
(vLLM's field) is on each completions choice, or on the chat body, of a non-streamed answer.

``return_token_ids`` (vLLM's): each choice carries ``token_ids``, the ids it generated (in a
stream, each chunk's own; with ``echo`` and ``max_tokens: 0`` none), and the prompt's ids come as
``prompt_token_ids``: on each completions choice, on the chat body; in a stream on a choice's first
completions chunk, on a chat stream's first chunk of each choice.
"""

from __future__ import annotations

import json
import logging
import time

from .api_errors import ApiError, error_body
from .engine_loop import Piece
from .logprobs import chat_logprobs, completion_logprobs, prompt_logprobs_json
from .prompts import Prompt
from .tool_call_stream import call_stream
from .tool_parsers import PARSERS, AutoToolStream
from .tools import tool_calls_of

log = logging.getLogger("dcpgraph.serving")


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


class Reply:
    """One request's answer in OpenAI's shapes: ``chat.completion`` / ``text_completion`` bodies,
    or their stream chunks, with logprobs in the chat or the completions format."""

    def __init__(self, server, prompts: list[Prompt], body, log_id: str, chat: bool,
                 choices: list[int]):
        self.server, self.prompts, self.body, self.log_id, self.chat = server, prompts, body, log_id, chat
        self.choices = choices
        self.created = int(time.time())
        self.wants_logprobs = body.requested_logprobs() is not None
        self.wants_prompt_logprobs = body.requested_prompt_logprobs() is not None
        self.echo = bool(getattr(body, "echo", False)) and not chat
        self.echo_only = self.echo and body.max_tokens == 0
        self.prompt_entries: dict[int, list] = {}  # per choice, from its first piece
        self.echoed: set[int] = set()  # choices whose prompt was put in front already
        self.offsets = {c: 0 for c in choices}  # completions' text_offset, per choice
        self.streamed = dict.fromkeys(choices, 0)  # tokens streamed so far, per choice
        options = body.stream_options
        self.final_usage = bool(options and options.include_usage)
        self.continuous_usage = self.final_usage and bool(options.continuous_usage_stats)
        parser = getattr(server, "reasoning", None) if chat else None  # the server's --reasoning-parser
        self.template_kwargs = getattr(body, "chat_template_kwargs", None)
        self.reasoning = parser  # vLLM's --reasoning-parser: <think>...</think> -> message.reasoning
        self.reasoning_streams = {c: parser.stream(self.template_kwargs) for c in choices} if parser else {}
        self.include_reasoning = getattr(body, "include_reasoning", True)  # vLLM's: False leaves it out
        self.token_ids = bool(getattr(body, "return_token_ids", False))
        self.prompt_ids_sent: set[int] = set()  # stream choices whose prompt_token_ids went out
        choice = getattr(body, "tool_choice", None) if chat and getattr(body, "tools", None) else None
        self.tool_choice = choice if choice not in (None, "none", "auto") else None
        parser = getattr(getattr(server, "options", None), "auto_tool_parser", None)
        self.auto_tool_parser = parser if choice == "auto" else None
        self.auto_streams = {c: AutoToolStream(parser) for c in choices} if self.auto_tool_parser else {}
        self.call_streams = {c: call_stream(self.tool_choice) for c in choices} if self.tool_choice else {}

    def logprobs_of(self, choice: int, token_ids: list[int], entries: list[dict]) -> dict | None:
        if not self.wants_logprobs:
            return None
        tokenizer = self.server.llm.tokenizer
        if self.chat:
            return chat_logprobs(tokenizer, token_ids, entries)
        value, self.offsets[choice] = completion_logprobs(tokenizer, token_ids, entries, self.offsets[choice])
        return value

    def prompt_of(self, choice: int) -> Prompt:
        return self.prompts[choice // self.body.n]

    def prompt_text(self, choice: int) -> str:
        """The prompt as given, or a token-id prompt decoded (vLLM detokenizes it for echo)."""
        prompt = self.prompt_of(choice)
        return prompt.text if prompt.text is not None else self.server.llm.tokenizer.decode(prompt.token_ids)

    def shown(self, piece: Piece) -> tuple[str, list[int], list]:
        """``piece``'s text, token ids and logprob entries as the client sees them (echo: the
        module docstring); records the choice's prompt entries when the piece carries them."""
        if piece.prompt_logprobs is not None:
            self.prompt_entries[piece.choice] = piece.prompt_logprobs
        if not self.echo or piece.choice in self.echoed:
            return piece.text, piece.token_ids, piece.logprobs
        self.echoed.add(piece.choice)
        ids, text = list(self.prompt_of(piece.choice).token_ids), self.prompt_text(piece.choice)
        entries = self.prompt_entries.get(piece.choice, []) if self.wants_logprobs else []
        if self.echo_only:
            return text, ids, entries
        return text + piece.text, ids + piece.token_ids, [*entries, *piece.logprobs]

    def prompt_logprobs_of(self, choice: int) -> dict:
        """``{"prompt_logprobs": [...]}`` when asked, else nothing."""
        if not self.wants_prompt_logprobs:
            return {}
        tokenizer = self.server.llm.tokenizer
        return {"prompt_logprobs": prompt_logprobs_json(tokenizer, self.prompt_of(choice).token_ids,
                                                        self.prompt_entries[choice])}

    def usage(self, generated: int) -> dict:
        prompt_tokens = sum(len(p.token_ids) for p in self.prompts) * self.body.n
        return {"prompt_tokens": prompt_tokens, "completion_tokens": generated,
                "total_tokens": prompt_tokens + generated}

    def choice_usage(self, choice: int) -> dict:
        """One choice's usage so far (its prompt's tokens, the tokens it generated): what
        ``stream_options.continuous_usage_stats`` puts on each of its chunks, as vLLM."""
        prompt_tokens = len(self.prompts[choice // self.body.n].token_ids)
        done = self.streamed[choice]
        return {"prompt_tokens": prompt_tokens, "completion_tokens": done, "total_tokens": prompt_tokens + done}

    async def whole(self, pieces) -> dict:
        """The non-streamed body: every choice's text, logprobs and finish reason, and the usage."""
        texts = {c: "" for c in self.choices}
        tokens: dict[int, tuple[list[int], list[dict]]] = {c: ([], []) for c in texts}
        generated_ids: dict[int, list[int]] = {c: [] for c in texts}
        reasons: dict[int, str | None] = {}
        generated = 0
        handover = None
        async for piece in pieces:
            text, token_ids, entries = self.shown(piece)
            texts[piece.choice] += text
            tokens[piece.choice][0].extend(token_ids)
            tokens[piece.choice][1].extend(entries)
            generated_ids[piece.choice].extend(self.generated_ids_of(piece))
            generated += len(piece.token_ids)
            self.server.generated += len(piece.token_ids)
            handover = piece.kv_transfer_params or handover
            if piece.finished:
                reasons[piece.choice] = piece.finish_reason
        choices = [
            {"index": c, **self.message_and_reason(texts[c], reasons[c]),
             "logprobs": self.logprobs_of(c, *tokens[c]), **self.token_ids_of(c, generated_ids[c])} if self.chat else
            {"index": c, "text": texts[c], "logprobs": self.logprobs_of(c, *tokens[c]), "finish_reason": reasons[c],
             **self.prompt_logprobs_of(c), **self.token_ids_of(c, generated_ids[c], prompt=True)}
            for c in sorted(texts)
        ]
        return {"id": self.log_id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.server.served_model_name, "choices": choices,
                "usage": self.usage(generated), **({"kv_transfer_params": handover} if handover else {}),
                **(self.prompt_logprobs_of(self.choices[0]) if self.chat else {}),
                **(self.prompt_token_ids_of(self.choices[0]) if self.chat else {})}

    def generated_ids_of(self, piece: Piece) -> list[int]:
        """The ids ``piece`` adds to its choice's ``token_ids`` (none for the one token an
        echo-only request runs)."""
        return [] if self.echo_only else list(piece.token_ids)

    def token_ids_of(self, choice: int, ids: list[int], *, prompt: bool = False) -> dict:
        """``{"token_ids": ids}`` (and, with ``prompt``, ``prompt_token_ids``) when asked."""
        if not self.token_ids:
            return {}
        return {**(self.prompt_token_ids_of(choice) if prompt else {}), "token_ids": ids}

    def prompt_token_ids_of(self, choice: int) -> dict:
        return {"prompt_token_ids": list(self.prompt_of(choice).token_ids)} if self.token_ids else {}

    def message_and_reason(self, text: str, reason: str | None) -> dict:
        """A chat choice's ``message`` and ``finish_reason``: the text as content, split by the
        reasoning parser, and its tool calls under a ``"required"`` or named ``tool_choice``."""
        message: dict = {"role": "assistant", "content": text}
        if self.reasoning is not None:
            reasoning, content = self.reasoning.split(text, self.template_kwargs)
            message = {"role": "assistant", "content": content,
                       "reasoning": reasoning if self.include_reasoning else None}
        return self.with_tool_calls(message, reason)

    def with_tool_calls(self, message: dict, reason: str | None) -> dict:
        """``{"message", "finish_reason"}`` with the calls the message's content holds (if any)."""
        if self.auto_tool_parser is not None:
            content, calls = PARSERS[self.auto_tool_parser](message["content"] or "")
            if calls:
                return {"message": {**message, "content": content, "tool_calls": calls}, "finish_reason": "tool_calls"}
        calls = tool_calls_of(message["content"] or "", self.tool_choice) if self.tool_choice else None
        if calls:
            message = {**message, "content": "", "tool_calls": calls}
            if self.tool_choice == "required" and reason == "stop":
                reason = "tool_calls"  # OpenAI's: "stop" for a named function
        return {"message": message, "finish_reason": reason}

    def delta(self, piece: Piece) -> tuple[dict, str | None]:
        """A chat chunk's delta and finish reason: the piece's text as content, or its reasoning
        and content parts (the parser's held-back text comes out with the last piece); under a
        ``"required"``, named or parsed ``"auto"`` ``tool_choice`` the calls go out as
        ``tool_calls`` deltas, their arguments fragment by fragment (:mod:`.tool_call_stream`)."""
        stream = self.reasoning_streams.get(piece.choice)
        if stream is None:
            reasoning, content = "", piece.text
        else:
            reasoning, content = stream.feed(piece.text)
            if piece.finished:
                more_reasoning, more_content = stream.finish()
                reasoning, content = reasoning + more_reasoning, content + more_content
        reason = piece.finish_reason
        delta = {"reasoning": reasoning} if reasoning and self.include_reasoning else {}
        calls = self.call_streams.get(piece.choice)
        if calls is not None:  # the constrained output is the calls, streamed as they are read
            tool_deltas, content = calls.feed(content), ""
            if tool_deltas:
                delta["tool_calls"] = tool_deltas
            if piece.finished and calls.calls and self.tool_choice == "required" and reason == "stop":
                reason = "tool_calls"
        auto = self.auto_streams.get(piece.choice)
        if auto is not None:
            content, tool_deltas = auto.feed(content)
            if piece.finished:
                rest, called = auto.finish()
                content += rest
                if called:
                    reason = "tool_calls"
            if tool_deltas:
                delta["tool_calls"] = tool_deltas
        if content or (stream is None and not self.tool_choice and auto is None and not piece.finished):
            delta["content"] = content
        return delta, reason

    def chunk(self, choices: list[dict], **extra) -> dict:
        return {"id": self.log_id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.server.served_model_name, "choices": choices, **extra}

    def choice_chunk(self, choice: dict) -> dict:
        """A chunk of one choice, with that choice's usage so far when continuous usage is asked."""
        extra = {"usage": self.choice_usage(choice["index"])} if self.continuous_usage else {}
        return self.chunk([choice], **extra)

    def chunk_choice(self, piece: Piece) -> dict:
        text, token_ids, entries = self.shown(piece)
        logprobs = self.logprobs_of(piece.choice, token_ids, entries)
        ids = self.token_ids_of(piece.choice, self.generated_ids_of(piece),
                                prompt=not self.chat and piece.choice not in self.prompt_ids_sent)
        self.prompt_ids_sent.add(piece.choice)
        if self.chat:
            delta, reason = self.delta(piece)
            return {"index": piece.choice, "delta": delta, "logprobs": logprobs, "finish_reason": reason, **ids}
        return {"index": piece.choice, "text": text, "logprobs": logprobs, "finish_reason": piece.finish_reason,
                **ids}

    def role_chunks(self) -> list[str]:
        """(chat) Each choice's first chunk, ``delta: {"role": "assistant", "content": ""}``."""
        return [_sse({**self.choice_chunk({"index": c, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                           "finish_reason": None}), **self.prompt_token_ids_of(c)})
                for c in self.choices]

    async def events(self, pieces):
        """The stream: a chunk per piece, (chat) preceded by the role chunks once the first piece
        has come (as vLLM, so a client timing its first chunk measures the first token, not the
        request's arrival), then the usage if asked, then ``[DONE]``; an engine failure ends it
        with an error event."""
        generated, started = 0, not self.chat
        try:
            async for piece in pieces:
                if not started:
                    started = True
                    for event in self.role_chunks():
                        yield event
                generated += len(piece.token_ids)
                self.streamed[piece.choice] += len(piece.token_ids)
                self.server.generated += len(piece.token_ids)
                yield _sse(self.choice_chunk(self.chunk_choice(piece)))
            if self.final_usage:
                yield _sse(self.chunk([], usage=self.usage(generated)))
            yield _sse("[DONE]")
        except ApiError as err:
            log.error("request %s: %s", self.log_id, err.message)
            yield _sse(error_body(err.status, err.message, err.kind))
