"""Tool calling with ``tool_choice`` ``"required"`` / a named function: the request's constraint
is vLLM's tool-call schema, a tiny random model's constrained output parses into calls whose
arguments validate against the tools' parameter schemas (``jsonschema``), and the request checks
are vLLM's."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import jsonschema
import pytest

from dcpgraph import LLM
from dcpgraph.config import DcpgraphConfig
from dcpgraph.errors import ConfigError
from dcpgraph.serving.api_server import ServerOptions
from dcpgraph.serving.engine_loop import Piece
from dcpgraph.serving.prompts import Prompt
from dcpgraph.serving.protocol import ChatCompletionRequest
from dcpgraph.serving.reasoning import ReasoningParser
from dcpgraph.serving.responses import Reply
from dcpgraph.serving.tool_call_stream import CallStream
from dcpgraph.serving.tool_parsers import AutoToolStream, parse_hermes, parse_llama3_json
from dcpgraph.serving.tools import tool_call_schema, tool_calls_of
from dcpgraph.testing.checkpoints import save_tiny_checkpoint

pytest.importorskip("xgrammar", reason="tool_choice required/named uses structured outputs (xgrammar)")

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 5},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "today's weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "now"}}]
MESSAGES = [{"role": "user", "content": "weather in Oslo?"}]


def request(temperature: float = 0.0, **fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=MESSAGES, tools=TOOLS, max_tokens=160, temperature=temperature, seed=7,
                                 structured_outputs={"disable_any_whitespace": True}, **fields)  # else padded JSON


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    model = save_tiny_checkpoint(tmp_path_factory.mktemp("tools") / "qwen3", "qwen3", layers=1)
    with LLM(model, dtype="float64", max_model_len=512, block_size=4) as llm:
        yield llm


def generate(llm, body: ChatCompletionRequest) -> str:
    params = body.sampling_params(body.max_tokens)
    assert params.structured_outputs.disable_any_whitespace
    out = llm.chat([m.for_template() for m in body.messages], params)[0].outputs[0]
    assert out.finish_reason == "stop", out.text
    return out.text


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_named_function_output_is_its_arguments(llm, temperature):
    body = request(temperature, tool_choice={"type": "function", "function": {"name": "weather"}})
    text = generate(llm, body)
    calls = tool_calls_of(text, body.tool_choice)
    assert [c["function"]["name"] for c in calls] == ["weather"] and calls[0]["id"].startswith("chatcmpl-tool-")
    jsonschema.validate(json.loads(calls[0]["function"]["arguments"], strict=False), WEATHER)


@pytest.mark.parametrize("parallel", [True, False])
def test_required_output_is_a_list_of_calls(llm, parallel):
    body = request(1.0, tool_choice="required", parallel_tool_calls=parallel)
    calls = tool_calls_of(generate(llm, body), "required")
    assert calls and (parallel or len(calls) == 1)
    for call in calls:
        arguments = json.loads(call["function"]["arguments"], strict=False)
        if call["function"]["name"] == "weather":
            jsonschema.validate(arguments, WEATHER)
        else:
            assert call["function"]["name"] == "now" and isinstance(arguments, dict)


def test_request_checks_and_template_inputs():
    assert request().tool_choice == "auto"  # vLLM's default with tools
    assert ChatCompletionRequest(messages=MESSAGES).tool_choice is None
    assert ChatCompletionRequest(messages=MESSAGES, tools=TOOLS, tool_choice="none").sampling_params(8) \
        .structured_outputs is None
    assert request(tool_choice="required").template_kwargs()["tools"][0]["function"]["name"] == "weather"
    with pytest.raises(ValueError, match=r"`tools` must be set"):
        ChatCompletionRequest(messages=MESSAGES, tool_choice="required")
    with pytest.raises(ValueError, match=r"does not match any of the specified `tools`"):
        request(tool_choice={"type": "function", "function": {"name": "nope"}})
    history = ChatCompletionRequest(messages=[
        *MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "content": "4 C", "tool_call_id": "c1"}])
    assert history.messages[1].for_template()["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert history.messages[2].for_template()["tool_call_id"] == "c1"
    schema = tool_call_schema(TOOLS, "required", False)
    assert schema["maxItems"] == 1 and schema["items"]["anyOf"][1]["properties"]["parameters"] == {
        "type": "object", "properties": {}}
    assert tool_calls_of('[{"name": "now", "parameters": {}', "required") is None  # cut short: stays content


HERMES = 'Let me check.<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>\n<tool_call>{"name": "now"'
LLAMA = '<|python_tag|>{"name": "weather", "parameters": {"city": "Oslo"}}; {"name": "now", "arguments": {}}'


def names_and_arguments(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_hermes_and_llama3_json_parsers():
    content, calls = parse_hermes(HERMES)
    assert content == HERMES and calls == []  # the unclosed last call is not JSON: all of it is content
    content, calls = parse_hermes(HERMES + ', "arguments": {}}')
    assert content == "Let me check." and names_and_arguments(calls) == [("weather", {"city": "Oslo"}), ("now", {})]
    assert parse_hermes("no calls") == ("no calls", [])
    content, calls = parse_llama3_json(LLAMA)
    assert content is None and names_and_arguments(calls) == [("weather", {"city": "Oslo"}), ("now", {})]
    assert parse_llama3_json("plain {text}") == ("plain {text}", [])
    assert parse_llama3_json('{"not": "a call"}') == ('{"not": "a call"}', [])


@pytest.mark.parametrize(("parser", "text"), [("hermes", HERMES + ', "arguments": {}}'), ("hermes", "just text <tool"),
                                              ("llama3_json", LLAMA), ("llama3_json", "  hello {x}")])
@pytest.mark.parametrize("cut", [1, 4, 7])
def test_auto_stream_equals_the_whole_parse(parser, text, cut):
    stream = AutoToolStream(parser)
    fed = [stream.feed(text[i:i + cut]) for i in range(0, len(text), cut)]
    rest, called = stream.finish()
    content, whole_calls = {"hermes": parse_hermes, "llama3_json": parse_llama3_json}[parser](text)
    assert "".join(c for c, _ in fed) + rest == (content or "") and called == bool(whole_calls)
    assert names_and_arguments(joined_calls([d for _, deltas in fed for d in deltas])) == \
        names_and_arguments(whole_calls)


def joined_calls(deltas: list[dict]) -> list[dict]:
    """Tool-call deltas joined per index, as a client accumulates them (names from first deltas,
    arguments concatenated)."""
    calls: dict[int, dict] = {}
    for d in deltas:
        call = calls.setdefault(d["index"], {"function": {"name": None, "arguments": ""}})
        if "id" in d:
            assert call["function"]["name"] is None and d["type"] == "function", d  # one first delta per call
            call["id"], call["function"]["name"] = d["id"], d["function"]["name"]
        call["function"]["arguments"] += d["function"].get("arguments", "")
    return [calls[i] for i in sorted(calls)]


SPLIT = '[{"name": "weather", "parameters": {"city": "O\\"s\\\\", "unit": "c", "n": [1, {"x": null}]}}, ' \
        '{"parameters": 5, "name": "now"}, {"name": "later"}]'


@pytest.mark.parametrize("cut", [1, 3, 1000])
def test_call_stream_sends_arguments_as_they_come(cut):
    stream = CallStream(call_depth=1, argument_keys=("parameters",))
    pieces = [stream.feed(SPLIT[i:i + cut]) for i in range(0, len(SPLIT), cut)]
    calls = joined_calls([d for p in pieces for d in p])
    assert names_and_arguments(calls) == [
        ("weather", {"city": 'O"s\\', "unit": "c", "n": [1, {"x": None}]}), ("now", 5), ("later", {})]
    hermes = CallStream(call_depth=0, argument_keys=("arguments",))
    text = '} ] <tool_call>{"name": "now", "arguments": {"a": [1]}}</tool_call>'  # stray closers first
    assert names_and_arguments(joined_calls(hermes.feed(text))) == [("now", {"a": [1]})]
    if cut == 1:  # the first call's arguments arrive in many fragments, before the call's object ends
        weather = [d for p in pieces for d in p if d["index"] == 0 and "id" not in d]
        assert len(weather) > 10 and all(set(d) == {"index", "function"} for d in weather)
        assert pieces.index([{"index": 0, "function": {"arguments": "{"}}]) < SPLIT.index("city")


def test_tool_flags_are_checked_at_start_up():
    serving = DcpgraphConfig.from_fields(model="m", enable_auto_tool_choice=True, tool_call_parser="hermes").serving
    assert serving.enable_auto_tool_choice and serving.tool_call_parser == "hermes"
    with pytest.raises(ConfigError, match=r"--enable-auto-tool-choice requires --tool-call-parser"):
        DcpgraphConfig.from_fields(model="m", enable_auto_tool_choice=True)
    with pytest.raises(ConfigError, match=r"--tool-call-parser mistral: not implemented .* \['hermes', 'llama3_json'\]"):
        DcpgraphConfig.from_fields(model="m", tool_call_parser="mistral")


def replies(text: str, cut: int, parser: str | None, **body) -> tuple[dict, list[dict]]:
    """The non-streamed choice and the streamed deltas (with the finish reason) of one output
    ``text`` cut into pieces of ``cut`` characters, under a deepseek_r1 reasoning parser."""
    whole, chunks = reply_chunks(text, cut, parser, **body)
    return whole, [{**c["choices"][0]["delta"], "finish": c["choices"][0]["finish_reason"]} for c in chunks]


def reply_chunks(text: str, cut: int, parser: str | None, **body) -> tuple[dict, list[dict]]:
    """The non-streamed choice and the stream's chunks (as JSON) of :func:`replies`."""
    server = SimpleNamespace(served_model_name="m", generated=0, llm=SimpleNamespace(tokenizer=None),
                             reasoning=ReasoningParser("deepseek_r1"), options=ServerOptions(auto_tool_parser=parser))
    request = ChatCompletionRequest.model_validate({"messages": MESSAGES, "tools": TOOLS, **body})

    async def pieces():
        for i in range(0, len(text), cut):
            last = i + cut >= len(text)
            yield Piece(choice=0, text=text[i:i + cut], token_ids=[1], finished=last,
                        finish_reason="stop" if last else None)

    def reply():
        return Reply(server, [Prompt("x", [1])], request, "chatcmpl-1", chat=True, choices=[0])

    whole = asyncio.run(reply().whole(pieces()))["choices"][0]
    events = asyncio.run(_collect(reply().events(pieces())))
    return whole, [json.loads(e.removeprefix("data: ")) for e in events[:-1]]


async def _collect(events):
    return [e async for e in events]


@pytest.mark.parametrize("cut", [1, 5])
@pytest.mark.parametrize(("parser", "choice", "text"), [
    (None, {"type": "function", "function": {"name": "weather"}}, 'hm</think>{"city": "Oslo", "unit": "c"}'),
    (None, "required", 'hm</think>[{"name": "now", "parameters": {}}]'),
    ("hermes", "auto", 'hm</think>ok<tool_call>{"name": "now", "arguments": {}}</tool_call>'),
    ("llama3_json", "auto", 'hm</think>{"name": "now", "parameters": {}}'),
    ("hermes", "auto", "hm</think>no call here"),
])
def test_streamed_deltas_carry_what_the_whole_body_does(cut, parser, choice, text):
    whole, deltas = replies(text, cut, parser, tool_choice=choice)
    message = whole["message"]
    assert "".join(d.get("reasoning", "") for d in deltas) == message["reasoning"] == "hm"
    assert "".join(d.get("content") or "" for d in deltas) == (message["content"] or "")
    streamed = joined_calls([c for d in deltas for c in d.get("tool_calls", [])])
    assert names_and_arguments(streamed) == names_and_arguments(message.get("tool_calls", []))
    assert deltas[-1]["finish"] == whole["finish_reason"]
    assert bool(streamed) == (text != "hm</think>no call here")
    expected = "stop" if isinstance(choice, dict) or not streamed else "tool_calls"
    assert whole["finish_reason"] == expected


def test_openai_stream_accumulation_rebuilds_the_calls():
    """The ``openai`` client's own stream accumulation (``ChatCompletionStreamState``, what
    ``client.chat.completions.stream`` uses) over the chunks of a streamed ``"required"`` answer
    cut into one-character pieces: the calls it rebuilds are the non-streamed answer's, and
    each call's arguments came in several deltas."""
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    text = 'hm</think>[{"name": "weather", "parameters": {"city": "Oslo", "unit": "c"}}, {"name": "now", "parameters": {}}]'
    whole, chunks = reply_chunks(text, 1, None, tool_choice="required")
    state = ChatCompletionStreamState()
    for chunk in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    final = state.get_final_completion().choices[0]
    assert final.finish_reason == whole["finish_reason"] == "tool_calls"
    rebuilt = [(c.function.name, json.loads(c.function.arguments)) for c in final.message.tool_calls]
    assert rebuilt == names_and_arguments(whole["message"]["tool_calls"])
    assert all(c.id.startswith("chatcmpl-tool-") and c.type == "function" for c in final.message.tool_calls)
    fragments = [c for ch in chunks for choice in ch["choices"] for c in choice["delta"].get("tool_calls") or []
                 if c["index"] == 0 and "id" not in c]
    assert len(fragments) > 5
