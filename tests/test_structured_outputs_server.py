"""Structured outputs and the reasoning parser on a real ``dcpgraph serve`` at tp=2 (worker
processes: rank 0 builds its grammar backend from the front end's serialized tokenizer
information), talked to with the ``openai`` client. The checkpoint pads its model vocabulary
(333) past the tokenizer's (321 + ``<think>``, ``</think>``), so the ids past the tokenizer must
be masked. A tiny random model's output is not JSON, so a valid output is the mask's doing."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from dcpgraph.testing.checkpoints import DEFAULT_VOCAB, save_tiny_checkpoint
from dcpgraph.testing.server import running_server

pytestmark = [pytest.mark.slow, pytest.mark.gloo]  # a tp=2 server subprocess (~60 s on 2 cores)
pytest.importorskip("xgrammar", reason="structured outputs need xgrammar (the serve and test extras)")

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "maximum": 99}},
          "required": ["ok", "n"], "additionalProperties": False}
REGEX = r"(yes|no)-[0-9]{3}"
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}  # a random model pads JSON otherwise


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("structured_server")
    model = save_tiny_checkpoint(root / "think", "qwen3", layers=1, vocab_size=333, tokenizer_vocab_size=DEFAULT_VOCAB)
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.save_pretrained(model)
    args = ("--dtype", "float64", "--block-size", "4", "--max-model-len", "256", "--served-model-name", "tiny",
            "--tensor-parallel-size", "2", "--gpu-memory-utilization", "0.002", "--generation-config", "vllm",
            "--reasoning-parser", "deepseek_r1", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
            "--speculative-config",
            '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1}')
    with running_server(model, *args, log_path=str(root / "server.log")) as s:
        s.think_end = tokenizer.convert_tokens_to_ids("</think>")
        yield s


def api(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def test_completions_follow_structured_outputs(server):
    client = api(server)
    for temperature in (0.0, 1.0):
        got = client.completions.create(model="tiny", prompt="yes-123 no-456 yes-", max_tokens=40, seed=1,
                                        temperature=temperature, extra_body={"structured_outputs": {"regex": REGEX}})
        assert re.fullmatch(REGEX, got.choices[0].text) and got.choices[0].finish_reason == "stop"
        got = client.completions.create(model="tiny", prompt="pick", max_tokens=40, seed=1, temperature=temperature,
                                        extra_body={"structured_outputs": {"choice": ["red", "green"]}})
        assert got.choices[0].text in ("red", "green")
    streamed = client.completions.create(model="tiny", prompt="x", max_tokens=60, temperature=0, stream=True,
                                         extra_body={"structured_outputs": {"json": SCHEMA,
                                                                            "disable_any_whitespace": True}})
    jsonschema.validate(json.loads("".join(c.choices[0].text for c in streamed), strict=False), SCHEMA)


def test_chat_response_format_after_the_reasoning(server):
    """The constraint starts after </think>: pushed first here, the content is the schema's JSON."""
    got = api(server).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "json please"}], max_tokens=60, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}},
        logit_bias={str(server.think_end): 100}, extra_body=COMPACT)
    message = got.choices[0].message
    assert message.reasoning is None or message.reasoning == ""
    jsonschema.validate(json.loads(message.content, strict=False), SCHEMA)
    obj = api(server).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=80, temperature=0,
        response_format={"type": "json_object"}, logit_bias={str(server.think_end): 100}, extra_body=COMPACT)
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content, strict=False), dict)


def test_reasoning_in_bodies_and_streams(server):
    client = api(server)
    messages = [{"role": "user", "content": "think"}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                           logit_bias={str(server.think_end): -100})
    assert whole.choices[0].message.content is None and whole.choices[0].message.reasoning
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                                 logit_bias={str(server.think_end): -100}, stream=True))
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning", None) or "" for c in chunks if c.choices)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert reasoning == whole.choices[0].message.reasoning and content == ""


def test_bad_constraints_are_400s_with_the_reason(server):
    client = api(server)
    with pytest.raises(openai.BadRequestError, match=r"structured_outputs.regex cannot be compiled"):
        client.completions.create(model="tiny", prompt="x", max_tokens=4, extra_body={"structured_outputs": {"regex": "(a"}})
    with pytest.raises(openai.BadRequestError, match=r"needs json_schema"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                       response_format={"type": "json_schema"})


TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": SCHEMA}}]


def streamed_calls(client: openai.OpenAI, **request):
    """A streamed chat answer as the ``openai`` client's stream helper accumulates it (its first
    choice), and the tool-call deltas that came, in order."""
    with client.chat.completions.stream(**request) as stream:
        deltas = [tc for event in stream if event.type == "chunk" and event.chunk.choices
                  for tc in (event.chunk.choices[0].delta.tool_calls or [])]
        final = stream.get_final_completion()
    return final.choices[0], deltas


def test_named_and_required_tool_calls_in_bodies_and_streams(server):
    client = api(server)
    common = {"model": "tiny", "messages": [{"role": "user", "content": "call it"}], "max_tokens": 200,
              "temperature": 0, "tools": TOOLS, "logit_bias": {str(server.think_end): 100},  # </think> first
              "extra_body": COMPACT}
    named = {"type": "function", "function": {"name": "lookup"}}
    whole = client.chat.completions.create(**common, tool_choice=named)
    call = whole.choices[0].message.tool_calls[0]
    assert whole.choices[0].finish_reason == "stop" and call.function.name == "lookup" and call.id
    jsonschema.validate(json.loads(call.function.arguments, strict=False), SCHEMA)
    final, deltas = streamed_calls(client, **common, tool_choice=named)
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == \
        [("lookup", call.function.arguments)]  # a named function's arguments are the output itself
    assert len(deltas) > 2 and deltas[0].id and all(d.id is None for d in deltas[1:])  # fragment by fragment
    required = client.chat.completions.create(**common, tool_choice="required")
    assert required.choices[0].finish_reason == "tool_calls"
    for call in required.choices[0].message.tool_calls:
        assert call.function.name == "lookup"
        jsonschema.validate(json.loads(call.function.arguments, strict=False), SCHEMA)
    final, deltas = streamed_calls(client, **common, tool_choice="required")
    assert final.finish_reason == "tool_calls" and len(deltas) > 2
    assert [(c.function.name, json.loads(c.function.arguments, strict=False)) for c in final.message.tool_calls] == \
        [(c.function.name, json.loads(c.function.arguments, strict=False)) for c in required.choices[0].message.tool_calls]
    history = [{"role": "user", "content": "call it"},
               {"role": "assistant", "content": None, "tool_calls": [{"id": call.id, "type": "function",
                                                                      "function": call.function.model_dump()}]},
               {"role": "tool", "content": "done", "tool_call_id": call.id}]
    assert client.chat.completions.create(model="tiny", messages=history, max_tokens=3).choices[0].message.reasoning


def test_auto_tool_choice_reads_hermes_calls(server):
    """``tool_choice`` "auto" (the default with tools): a regex makes the output a hermes call."""
    call = r'<tool_call>\{"name": "lookup", "arguments": \{"ok": (true|false), "n": [0-9]\}\}</tool_call>'
    common = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 160, "temperature": 0,
              "tools": TOOLS, "logit_bias": {str(server.think_end): 100},
              "extra_body": {"structured_outputs": {"regex": "ok then" + call}}}
    whole = api(server).chat.completions.create(**common)
    message = whole.choices[0].message
    assert whole.choices[0].finish_reason == "tool_calls" and message.content == "ok then"
    jsonschema.validate(json.loads(message.tool_calls[0].function.arguments), SCHEMA)
    final, deltas = streamed_calls(api(server), **common)
    assert final.message.content == "ok then" and final.finish_reason == "tool_calls" and len(deltas) > 2
    assert [(c.function.name, json.loads(c.function.arguments)) for c in final.message.tool_calls] == \
        [("lookup", json.loads(message.tool_calls[0].function.arguments))]
    plain = api(server).chat.completions.create(**{**common, "extra_body": {}, "max_tokens": 8,
                                                   "logit_bias": {str(server.think_end): -100}})
    assert plain.choices[0].message.tool_calls in (None, []) and plain.choices[0].finish_reason == "length"
