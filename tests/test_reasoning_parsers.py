"""Reasoning parsers (``--reasoning-parser qwen3|deepseek_r1``): the split of a whole output into
``reasoning`` and ``content``, and the same split from any cut of it into stream deltas (the
concatenated deltas must equal the whole output's parts, markers split across deltas included)."""

from __future__ import annotations

import pytest

from dcpgraph.config import DcpgraphConfig
from dcpgraph.errors import ConfigError
from dcpgraph.serving.reasoning import ReasoningParser
from dcpgraph.testing.checkpoints import byte_level_tokenizer

CASES = [
    ("<think>plan a</think>\n\nanswer", ("plan a", "\n\nanswer")),
    ("plan a</think>answer", ("plan a", "answer")),
    ("plan a</think>", ("plan a", None)),
    ("still thinking <thi", ("still thinking <thi", None)),
    ("x</thinking> and </think>y</think>", ("x</thinking> and ", "y</think>")),
    ("", ("", None)),
]


@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1"])
@pytest.mark.parametrize(("text", "expected"), CASES)
def test_whole_output_split(name, text, expected):
    assert ReasoningParser(name).split(text) == expected


def test_qwen3_without_thinking_is_all_content():
    assert ReasoningParser("qwen3").split("a</think>b", {"enable_thinking": False}) == (None, "a</think>b")
    assert ReasoningParser("deepseek_r1").split("a</think>b", {"enable_thinking": False}) == ("a", "b")


@pytest.mark.parametrize("text", [t for t, _ in CASES])
@pytest.mark.parametrize("cut", [1, 2, 3, 5])
def test_stream_deltas_add_up_to_the_whole_split(text, cut):
    parser = ReasoningParser("deepseek_r1")
    stream = parser.stream()
    parts = [stream.feed(text[i:i + cut]) for i in range(0, len(text), cut)] + [stream.finish()]
    reasoning, content = ("".join(p[i] for p in parts) for i in (0, 1))
    expected = parser.split(text)
    assert reasoning == expected[0] and content == (expected[1] or "")


def test_end_token_id_and_the_flags():
    tokenizer = byte_level_tokenizer(321)
    assert ReasoningParser.for_tokenizer("qwen3", tokenizer).end_token_id is None  # not one token here
    tokenizer.add_tokens(["<think>", "</think>"])
    assert ReasoningParser.for_tokenizer("qwen3", tokenizer).end_token_id == 322
    with pytest.raises(ValueError, match=r"'granite' is not implemented; choose from \['qwen3', 'deepseek_r1'\]"):
        ReasoningParser.for_tokenizer("granite", tokenizer)
    assert DcpgraphConfig.from_fields(model="m", reasoning_parser="qwen3").serving.reasoning_parser == "qwen3"
    with pytest.raises(ConfigError, match=r"--reasoning-parser gpt_oss: not implemented"):
        DcpgraphConfig.from_fields(model="m", reasoning_parser="gpt_oss")
