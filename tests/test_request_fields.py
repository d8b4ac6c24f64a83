"""vLLM request fields checked without a server: the ones refused by name (each given a value that
asks for something; the values that ask nothing pass), ``documents`` reaching the chat template,
``include_reasoning: false`` leaving the reasoning out of whole and streamed answers, and a
``response_format`` structural tag replacing ``structured_outputs``' own constraint."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from dcpgraph.serving.engine_loop import Piece
from dcpgraph.serving.prompts import Prompt, chat_prompt
from dcpgraph.serving.protocol import ChatCompletionRequest, CompletionRequest
from dcpgraph.serving.reasoning import ReasoningParser
from dcpgraph.serving.responses import Reply
from dcpgraph.testing.vllm_bench import word_tokenizer

MESSAGES = [{"role": "user", "content": "w1 w2"}]


@pytest.mark.parametrize(("field", "value", "needle"), [
    ("prompt_embeds", "AAAA", "prompt embeddings are not supported"),
    ("priority", 3, "priority scheduling is not supported"),
    ("logits_processors", ["m.P"], "custom logits processors"),
    ("vllm_xargs", {"k": 1}, "vllm_xargs"),
    ("return_tokens_as_token_ids", True, "return_tokens_as_token_ids is not supported"),
    ("cache_salt", "tenant-a", "cache_salt is not supported"),
    ("chat_template", "{{ messages }}", "--chat-template"),
])
def test_fields_asking_for_what_is_not_implemented_are_refused_by_name(field, value, needle):
    with pytest.raises(ValueError, match=rf"{field}: .*{needle}"):
        ChatCompletionRequest(messages=MESSAGES, **{field: value})
    if field != "chat_template":
        with pytest.raises(ValueError, match=rf"{field}: "):
            CompletionRequest(prompt="w1", **{field: value})


def test_values_that_ask_nothing_pass():
    body = ChatCompletionRequest(messages=MESSAGES, priority=0, return_token_ids=False, cache_salt=None,
                                 logits_processors=None, return_tokens_as_token_ids=False)
    assert body.sampling_params(4).max_tokens == 4


def test_documents_reach_the_chat_template():
    template = ("{% for d in documents %}[{{ d['title'] }}: {{ d['text'] }}] {% endfor %}"
                "{% for m in messages %}{{ m['content'] }} {% endfor %}")
    body = ChatCompletionRequest(messages=MESSAGES, documents=[{"title": "w7", "text": "w8 w9"}])
    prompt = chat_prompt(word_tokenizer(64), [m.for_template() for m in body.messages], chat_template=template,
                         **body.template_kwargs())
    assert prompt.text == "[w7: w8 w9] w1 w2 "
    assert "documents" not in ChatCompletionRequest(messages=MESSAGES).template_kwargs()


def answers(include_reasoning: bool, text: str = "hm</think>ok") -> tuple[dict, list[dict]]:
    """The whole message and the streamed deltas of ``text`` (two-character pieces) under a
    deepseek_r1 reasoning parser."""
    server = SimpleNamespace(served_model_name="m", generated=0, llm=SimpleNamespace(tokenizer=None),
                             reasoning=ReasoningParser("deepseek_r1"))
    body = ChatCompletionRequest(messages=MESSAGES, include_reasoning=include_reasoning)

    async def pieces():
        for i in range(0, len(text), 2):
            last = i + 2 >= len(text)
            yield Piece(choice=0, text=text[i:i + 2], token_ids=[1], finished=last,
                        finish_reason="stop" if last else None)

    async def collect(events):
        return [e async for e in events]

    def reply():
        return Reply(server, [Prompt("x", [1])], body, "chatcmpl-1", chat=True, choices=[0])

    whole = asyncio.run(reply().whole(pieces()))["choices"][0]["message"]
    events = asyncio.run(collect(reply().events(pieces())))
    return whole, [json.loads(e.removeprefix("data: "))["choices"][0]["delta"] for e in events[:-1]]


def test_include_reasoning_false_leaves_the_reasoning_out():
    whole, deltas = answers(True)
    assert (whole["reasoning"], whole["content"]) == ("hm", "ok")
    assert "".join(d.get("reasoning", "") for d in deltas) == "hm"
    whole, deltas = answers(False)
    assert (whole["reasoning"], whole["content"]) == (None, "ok")
    assert not any("reasoning" in d for d in deltas)
    assert "".join(d.get("content") or "" for d in deltas) == "ok"


def test_response_format_structural_tag_replaces_structured_outputs_constraint():
    tag = {"type": "structural_tag", "format": {"type": "const_string", "value": "w1"}}
    body = ChatCompletionRequest(messages=MESSAGES, response_format=tag,
                                 structured_outputs={"json": {"type": "object"}, "disable_any_whitespace": True})
    constraint = body.sampling_params(4).structured_outputs
    assert json.loads(constraint.structural_tag) == tag and constraint.json is None
    assert constraint.disable_any_whitespace


def test_min_tokens_with_a_constraint_is_refused_by_name():
    """A complete constrained output allows only EOS, which ``min_tokens`` masks: no token would be
    left, so the combination is refused (also through a tool choice that constrains the output)."""
    from dcpgraph.serving.params import SamplingParams

    with pytest.raises(ValueError, match=r"min_tokens cannot be combined with structured_outputs"):
        SamplingParams(min_tokens=2, structured_outputs={"regex": "w1"})
    tools = [{"type": "function", "function": {"name": "f"}}]
    body = ChatCompletionRequest(messages=MESSAGES, tools=tools, tool_choice="required", min_tokens=2)
    with pytest.raises(ValueError, match=r"min_tokens cannot be combined with structured_outputs"):
        body.sampling_params(8)
    assert SamplingParams(min_tokens=2).min_tokens == 2
