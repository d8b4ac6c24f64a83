"""OpenAI request bodies with vLLM's fields, names, shapes and defaults.

As vLLM does, a field this server does not know is ignored and logged at WARNING (not refused),
and ``null`` for a field whose value cannot be null (``temperature``, ``top_p``, ``top_k``, the
penalties, ``stream``, ``n``...) means that field's default. A known field with a bad value is a
400. vLLM fields whose meaning dcpgraph does not implement yet are refused by name with the reason
(:data:`UNSUPPORTED`) rather than ignored: silently dropping ``prompt_logprobs`` or ``echo``
would pretend to honour them.

Log-probabilities: completions take ``logprobs`` (an int, 0–20: top-N per token), chat takes
``logprobs: true`` with ``top_logprobs`` (0–20; giving it without ``logprobs: true`` is an error,
as in OpenAI's API). vLLM's ``prompt_logprobs`` (0–20, both endpoints) returns each prompt token's
log-probability and the top-N at its position (the first token's is ``null``). Completions take
``echo`` (vLLM's meaning: the prompt's text is prepended to the completion's and, with
``logprobs``, the logprobs cover the prompt tokens too, the first one ``null``; ``prompt_logprobs``
then defaults to ``logprobs``); ``max_tokens: 0`` is accepted with ``echo`` only and returns the
prompt alone (the engine still runs one token, counted in the usage as vLLM does). Chat refuses
``echo``. ``presence_penalty``/``frequency_penalty`` are in [-2, 2]. vLLM's extensions
``top_k``, ``min_p``, ``repetition_penalty``, ``stop_token_ids``, ``ignore_eos``, ``min_tokens``,
``logit_bias`` (clamped to [-100, 100] as vLLM does), ``allowed_token_ids``, ``bad_words``,
``truncate_prompt_tokens``, ``skip_special_tokens`` and ``include_stop_str_in_output`` are
accepted (their meaning: :mod:`dcpgraph.runtime.sampling_params`). ``best_of`` must be null or
equal ``n``. Chat messages take a string ``content`` or a list of ``{"type": "text", "text"}``
parts (joined with newlines, as vLLM's string content format); other part types are refused.
``chat_template_kwargs`` go to the tokenizer's ``apply_chat_template`` (e.g. Qwen3's
``enable_thinking``).

Structured outputs: ``response_format`` (``{"type": "json_object"}``, ``{"type":
"json_schema", "json_schema": {"name", "schema"}}`` or vLLM's ``{"type": "structural_tag", ...}``;
``"text"`` asks nothing) and vLLM's ``structured_outputs`` object (``json``, ``regex``, ``choice``,
``grammar``, ``json_object``, ``structural_tag``, ``disable_any_whitespace``: :class:`~dcpgraph.runtime.structured_outputs.StructuredOutputsParams`);
a ``response_format`` constraint replaces ``structured_outputs``' own, as in vLLM.

Tools (chat): ``tools`` (function tools, passed to the chat template), ``tool_choice``
(``"none"``, ``"auto"``, ``"required"`` or ``{"type": "function", "function": {"name"}}``;
``"auto"`` when ``tools`` are given without one, as vLLM), ``parallel_tool_calls``; assistant
messages may carry ``tool_calls`` and tool messages ``tool_call_id``. What each choice does:
:mod:`.tools`.
"""

from __future__ import annotations

import json
import logging
import types
import typing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..runtime.sampling import MAX_LOGPROBS
from ..runtime.structured_outputs import CONSTRAINTS, check_structural_tag
from .params import SamplingParams
from .tools import tool_call_schema

log = logging.getLogger("dcpgraph.serving")
LOGIT_BIAS_LIMIT = 100.0  # vLLM clamps each bias to [-100, 100]

_GUIDED = ("the guided_* fields are gone from vLLM; use structured_outputs: {\"json\"|\"regex\"|\"choice\"|"
           "\"grammar\"|\"json_object\": ...}")

# vLLM request fields another part of dcpgraph has yet to implement: field -> why it is refused.
# A field is refused only when given a value that asks for something ("tools": [] is accepted).
UNSUPPORTED = {
    "guided_json": _GUIDED, "guided_regex": _GUIDED, "guided_choice": _GUIDED, "guided_grammar": _GUIDED,
    "use_beam_search": "beam search is not supported",
    "suffix": "suffix (fill-in-the-middle) is not supported",
    "prompt_embeds": "prompt embeddings are not supported (vLLM needs --enable-prompt-embeds for them too)",
    "priority": "priority scheduling is not supported (the scheduler is first come, first served; vLLM refuses a "
                "priority too unless started with --scheduling-policy priority)",
    "logits_processors": "custom logits processors are not supported",
    "vllm_xargs": "vllm_xargs (arguments for custom logits processors) are not supported",
    "return_tokens_as_token_ids": "return_tokens_as_token_ids is not supported",
    "cache_salt": "cache_salt is not supported (prefix-cache isolation per salt is not implemented)",
    "chat_template": "a chat template per request is not supported; start the server with --chat-template "
                     "(vLLM also refuses it unless started with --trust-request-chat-template)",
}
_ASKS_NOTHING = (None, False, [], {}, {"type": "text"}, "", "none", "auto")


def _admits_none(annotation: Any) -> bool:
    return annotation is Any or type(None) in typing.get_args(annotation) or (
        isinstance(annotation, types.UnionType) and type(None) in annotation.__args__)


class LenientModel(BaseModel):
    """vLLM's ``OpenAIBaseModel`` behaviour: unknown fields are kept aside (``model_extra``) and
    logged at WARNING, never refused; ``null`` for a field that cannot be null is its default."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items()
                if not (v is None and k in fields and not _admits_none(fields[k].annotation))}

    @model_validator(mode="after")
    def _log_ignored(self):
        ignored = sorted(set(self.model_extra or ()) - set(UNSUPPORTED))  # those are refused or ask nothing
        if ignored:
            log.warning("%s: fields ignored (this server does not know them): %s", type(self).__name__, ignored)
        return self


class JsonSchemaResponseFormat(LenientModel):
    """OpenAI's ``response_format.json_schema``: the schema is under ``schema``."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)
    name: str
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(LenientModel):
    """``{"type": "text" | "json_object" | "json_schema", "json_schema": {...}}``, or vLLM's
    ``{"type": "structural_tag", "format": {...}}`` / ``{"type": "structural_tag", "structures":
    [...], "triggers": [...]}`` (:mod:`~dcpgraph.runtime.structured_outputs`)."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaResponseFormat | None = None
    format: dict[str, Any] | None = None
    structures: list[dict[str, Any]] | None = None
    triggers: list[str] | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.json_schema is None):
            raise ValueError('response_format type "json_schema" needs json_schema: {"name": ..., "schema": {...}}')
        if self.type == "structural_tag":
            check_structural_tag(self.constraint()["structural_tag"])
        return self

    def constraint(self) -> dict | None:
        """The ``structured_outputs`` fields it asks for (``None`` for text)."""
        if self.type == "json_object":
            return {"json_object": True}
        if self.type == "json_schema":
            return {"json": self.json_schema.json_schema}
        if self.type == "structural_tag":  # vLLM passes the whole object on as the tag's text
            if self.structures is not None:
                tag = {"type": "structural_tag", "structures": self.structures, "triggers": self.triggers}
            else:
                tag = {"type": "structural_tag", "format": self.format}
            return {"structural_tag": json.dumps(tag)}
        return None


class StreamOptions(LenientModel):
    """``include_usage``: a last chunk with the request's usage; ``continuous_usage_stats`` (vLLM's,
    with ``include_usage``): every chunk also carries its choice's usage so far."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Common(LenientModel):
    model: str | None = None
    n: int = Field(1, ge=1, le=16)
    best_of: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False  # vLLM's: prompt_token_ids and each choice's token_ids in the answer
    min_tokens: int = Field(0, ge=0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    kv_transfer_params: dict[str, Any] | None = None  # P/D: see serving/kv_connector/agent.py
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None

    def structured_constraint(self) -> dict | None:
        """``structured_outputs`` with ``response_format``'s constraint in place of its own (as
        vLLM: the response format overrides the constraint fields, keeping the options)."""
        asked = self.response_format.constraint() if self.response_format is not None else None
        if asked is None:
            return self.structured_outputs
        options = {k: v for k, v in (self.structured_outputs or {}).items() if k not in CONSTRAINTS}
        return {**options, **asked}

    @model_validator(mode="after")
    def _refuse_unsupported(self):
        for name, value in (self.model_extra or {}).items():
            if name in UNSUPPORTED and not any(value == nothing for nothing in _ASKS_NOTHING):
                raise ValueError(f"{name}: {UNSUPPORTED[name]}")
        if self.stream and self.prompt_logprobs:  # vLLM's rule (0 asks for the prompt tokens' own figures only)
            raise ValueError("prompt_logprobs are not available when stream is true (as in vLLM); use 0, null or "
                             "a non-streamed request")
        if self.best_of not in (None, self.n):
            raise ValueError(f"best_of ({self.best_of}) must be null or equal n ({self.n}): dcpgraph returns "
                             "every sampled completion and does not rank best_of > n candidates")
        return self

    def requested_logprobs(self) -> int | None:
        """Top-N log-probabilities per generated token (``None``: none)."""
        return None

    def requested_prompt_logprobs(self) -> int | None:
        """Top-N log-probabilities per prompt token (``None``: none)."""
        return self.prompt_logprobs

    def sampling_params(self, max_tokens: int | None) -> SamplingParams:
        bias = None if self.logit_bias is None else {
            k: max(-LOGIT_BIAS_LIMIT, min(LOGIT_BIAS_LIMIT, v)) for k, v in self.logit_bias.items()}
        return SamplingParams(n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              min_p=self.min_p, seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
                              ignore_eos=self.ignore_eos, max_tokens=max_tokens, min_tokens=self.min_tokens,
                              logprobs=self.requested_logprobs(), prompt_logprobs=self.requested_prompt_logprobs(),
                              presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                              repetition_penalty=self.repetition_penalty, logit_bias=bias,
                              allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words,
                              truncate_prompt_tokens=self.truncate_prompt_tokens,
                              skip_special_tokens=self.skip_special_tokens,
                              include_stop_str_in_output=self.include_stop_str_in_output,
                              structured_outputs=self.structured_constraint())


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_special_tokens: bool = True
    echo: bool = False

    @model_validator(mode="after")
    def _zero_tokens_needs_echo(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens must be at least 1; 0 is accepted only with echo: true (the prompt alone)")
        return self

    @property
    def echo_only(self) -> bool:
        """``echo`` with ``max_tokens: 0``: the answer is the prompt alone."""
        return self.echo and self.max_tokens == 0

    def engine_max_tokens(self) -> int | None:
        """The tokens the engine generates: one for ``echo_only`` (vLLM's), else ``max_tokens``."""
        return 1 if self.echo_only else self.max_tokens

    def requested_prompt_logprobs(self) -> int | None:
        """vLLM's: ``echo`` with ``logprobs`` and no ``prompt_logprobs`` asks for ``logprobs`` of them."""
        if self.prompt_logprobs is None and self.echo:
            return self.logprobs
        return self.prompt_logprobs

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, value: Any) -> Any:
        if isinstance(value, list) and not value:
            raise ValueError("prompt must not be empty")
        return value

    def requested_logprobs(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list:
        """The prompts as :func:`.prompts.encode_prompt` takes them (strings or token-id lists)."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


class ContentPart(LenientModel):
    """One part of a chat message's content: only ``text`` parts (a text-only model)."""

    type: Literal["text"]
    text: str


def _text_parts_only(content: Any) -> Any:
    """A clear refusal of a content part that is not text, before pydantic tries each type."""
    for part in content if isinstance(content, list) else ():
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            raise ValueError(f"content part type {kind!r} is not supported: this server serves a text-only model, "
                             'so content parts must be {"type": "text", "text": ...}')
    return content


class FunctionCall(LenientModel):
    name: str
    arguments: str


class ToolCall(LenientModel):
    """An assistant message's earlier call, as the response gave it."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall

    def for_template(self) -> dict:
        """As chat templates read it (vLLM's): ``arguments`` parsed to an object when it is JSON."""
        try:
            arguments = json.loads(self.function.arguments)
        except json.JSONDecodeError:
            arguments = self.function.arguments
        return {"id": self.id, "type": "function", "function": {"name": self.function.name, "arguments": arguments}}


class FunctionDefinition(LenientModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ChatTool(LenientModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatMessage(LenientModel):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCall] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        return _text_parts_only(value)

    def for_template(self) -> dict:
        """The message as a chat template reads it: text parts joined with newlines (vLLM's
        string content format); fields the server does not know are not passed on."""
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        message = {"role": self.role, "content": content if content is not None else ""}
        message.update({k: v for k, v in (("name", self.name), ("tool_call_id", self.tool_call_id)) if v is not None})
        if self.tool_calls:
            message["tool_calls"] = [call.for_template() for call in self.tool_calls]
        return message


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, str]] | None = None  # for RAG chat templates, as vLLM
    include_reasoning: bool = True  # False: a --reasoning-parser's reasoning is left out of the answer
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True

    @model_validator(mode="before")
    @classmethod
    def _tool_choice_default(cls, data: Any) -> Any:
        """vLLM's default: ``"auto"`` when ``tools`` are given without a ``tool_choice``."""
        if isinstance(data, dict) and data.get("tools") and data.get("tool_choice") is None:
            return {**data, "tool_choice": "auto"}
        return data

    @model_validator(mode="after")
    def _tool_choice_names_a_tool(self) -> ChatCompletionRequest:
        choice = self.tool_choice
        if choice in (None, "none"):
            return self
        if not self.tools:
            raise ValueError("When using `tool_choice`, `tools` must be set.")
        if isinstance(choice, dict):
            name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
            if not isinstance(name, str):
                raise ValueError('tool_choice as an object must be {"type": "function", "function": {"name": ...}}')
            if name not in {t.function.name for t in self.tools}:
                raise ValueError(f"The tool specified in `tool_choice` ({name!r}) does not match any of the "
                                 f"specified `tools`: {[t.function.name for t in self.tools]}")
        return self

    def structured_constraint(self) -> dict | None:
        """A ``"required"`` or named ``tool_choice`` constrains the output to its tool-call schema
        (replacing ``response_format``'s and ``structured_outputs``' constraint, as vLLM; the
        latter's ``disable_any_whitespace`` is kept)."""
        if self.tools and self.tool_choice not in (None, "none", "auto"):
            tools = [t.model_dump() for t in self.tools]
            compact = bool((self.structured_outputs or {}).get("disable_any_whitespace"))
            return {"json": tool_call_schema(tools, self.tool_choice, self.parallel_tool_calls),
                    **({"disable_any_whitespace": True} if compact else {})}
        return super().structured_constraint()

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatCompletionRequest:
        if self.echo:
            raise ValueError("echo: chat's echo (prepending the last message) is not supported; /v1/completions "
                             "supports echo")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt: false (as vLLM)")
        return self

    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``apply_chat_template`` beyond the messages."""
        tools = {"tools": [t.model_dump(exclude_none=True) for t in self.tools]} if self.tools else {}
        documents = {"documents": self.documents} if self.documents else {}
        return {**(self.chat_template_kwargs or {}), **tools, **documents, "add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message}
