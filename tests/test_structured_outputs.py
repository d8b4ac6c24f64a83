"""Structured outputs: xgrammar's logits mask on every sampled and verified row.

A tiny random model's greedy text is not JSON (checked here as the control), so a valid output is
the mask's doing: JSON outputs are parsed and validated against the schema with ``jsonschema``
(an independent validator), ``choice`` outputs are one of the choices, ``regex`` outputs
fullmatch. Greedy and seeded sampling, tp=1 in process and tp=2/dcp=2 emulated; with ngram
speculation the greedy output is token-identical to the one without drafts (drafts are checked
against the grammar and the matcher is rolled back over the rejected ones).
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from dcpgraph import LLM
from dcpgraph.errors import GrammarError
from dcpgraph.runtime.grammar import GrammarBackend, choice_grammar
from dcpgraph.runtime.structured_outputs import StructuredOutputsParams
from dcpgraph.serving.params import SamplingParams
from dcpgraph.serving.protocol import ChatCompletionRequest
from dcpgraph.testing.checkpoints import byte_level_tokenizer, save_tiny_checkpoint

pytest.importorskip("xgrammar", reason="structured outputs need xgrammar (the serve and test extras)")

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 4},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
COMPACT = {"disable_any_whitespace": True}  # a random model would otherwise pad JSON with whitespace
CHOICES = ["yes", "no way", "maybe \"so\""]
REGEX = r"[a-c]{2,4}-\d{2}(x|yz)"
PROMPTS = ["hello there", "abcabcabc"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("so") / "qwen3", "qwen3", layers=1)


@pytest.fixture(scope="module")
def llm(model_dir):
    with LLM(model_dir, dtype="float64", max_model_len=256, block_size=4) as llm:
        yield llm


def loads(text: str):
    """JSON with raw control characters allowed inside strings: xgrammar's JSON grammar (as in
    vLLM) admits every character but ``"``, ``\\``, CR and LF unescaped in a string."""
    return json.loads(text, strict=False)


def texts(llm, constraint, temperature=0.0, max_tokens=80, prompts=PROMPTS):
    params = SamplingParams(temperature=temperature, seed=3, max_tokens=max_tokens, structured_outputs=constraint)
    return [(o.outputs[0].text, o.outputs[0].finish_reason, o.outputs[0].token_ids) for o in llm.generate(prompts, params)]


def check_outputs(llm, temperature):
    for text, reason, _ in texts(llm, {"json": SCHEMA, **COMPACT}, temperature):
        assert reason == "stop", text
        jsonschema.validate(loads(text), SCHEMA)
    for text, reason, _ in texts(llm, {"json_object": True, **COMPACT}, temperature, max_tokens=96):
        if reason == "stop":  # an object may be cut by max_tokens; a finished one parses
            assert isinstance(loads(text), dict), text
        else:
            assert text.startswith("{")
    for text, reason, _ in texts(llm, {"choice": CHOICES}, temperature):
        assert text in CHOICES and reason == "stop"
    for text, reason, _ in texts(llm, {"regex": REGEX}, temperature):
        assert re.fullmatch(REGEX, text) and reason == "stop", text


def test_unconstrained_greedy_text_is_not_json(llm):
    """The control: without the mask this model's output is not what the constraints force."""
    for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24)):
        with pytest.raises(ValueError):
            json.loads(o.outputs[0].text)
        assert o.outputs[0].text not in CHOICES and not re.fullmatch(REGEX, o.outputs[0].text)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_outputs_satisfy_their_constraint_tp1(llm, temperature):
    check_outputs(llm, temperature)


def test_ebnf_grammar_and_response_format(llm):
    grammar = 'root ::= "(" digits ("+" digits)* ")"\ndigits ::= [0-9]+'
    for text, reason, _ in texts(llm, {"grammar": grammar}):
        assert re.fullmatch(r"\(\d+(\+\d+)*\)", text) and reason == "stop", text
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}],
                                 response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}},
                                 structured_outputs={"regex": "x", **COMPACT})
    params = body.sampling_params(40)
    assert params.structured_outputs == StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)


def test_speculative_drafts_are_checked_against_the_grammar(model_dir, llm):
    """ngram drafts under a grammar: the same greedy tokens as without speculation, drafts were
    proposed, and some were refused by the grammar or by the target (the rollback path ran)."""
    prompts = ["ab-12x ab-12x ab-12x ab-", "{\"name\":\"ab\",\"age\":1,\"tags\":[\"a\"]} {\"name\":\"ab\""]
    constraints = [{"regex": REGEX}, {"json": SCHEMA, **COMPACT}, {"choice": CHOICES}]
    plain = [texts(llm, c, prompts=prompts) for c in constraints]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    with LLM(model_dir, dtype="float64", max_model_len=256, block_size=4, speculative_config=spec) as drafted:
        assert [texts(drafted, c, prompts=prompts) for c in constraints] == plain
        stats = drafted.engine.report()["speculative"]
        sampled = texts(drafted, {"json": SCHEMA, **COMPACT}, temperature=1.0, prompts=prompts)
    assert stats["drafted"] > 0 and stats["accepted"] < stats["drafted"]
    for text, _, _ in sampled:
        jsonschema.validate(loads(text), SCHEMA)


def test_speculative_drafts_under_a_grammar_with_a_recurrent_hybrid(tmp_path):
    """A hybrid (LFM2's short convolutions) verifies ngram drafts under a grammar: the rows that
    ran more tokens than they keep are replayed with the count each kept, not with the grammar's
    list of allowed drafts (a name the runner once reused). Greedy tokens equal those without
    speculation."""
    import transformers

    config = transformers.Lfm2Config(vocab_size=320, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                     num_attention_heads=4, num_key_value_heads=2, conv_L_cache=3,
                                     layer_types=["conv", "full_attention", "conv"], eos_token_id=257)
    torch.manual_seed(0)
    transformers.Lfm2ForCausalLM(config).save_pretrained(tmp_path)
    byte_level_tokenizer(320).save_pretrained(tmp_path)
    prompts = ["ab-12x ab-12x ab-12x ab-", "cc-99yz cc-99yz c"]
    args = {"dtype": "float32", "max_model_len": 64, "block_size": 4}
    with LLM(str(tmp_path), **args) as plain:
        want = texts(plain, {"regex": REGEX}, max_tokens=30, prompts=prompts)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    with LLM(str(tmp_path), **args, speculative_config=spec) as drafted:
        assert texts(drafted, {"regex": REGEX}, max_tokens=30, prompts=prompts) == want
        replays = drafted.engine.report()["speculative"]["state_replays"]
    assert replays["rows"] > 0


def test_outputs_satisfy_their_constraint_tp2_dcp2(model_dir, llm):
    with LLM(model_dir, dtype="float64", max_model_len=256, block_size=4, tensor_parallel_size=2,
             decode_context_parallel_size=2, distributed_executor_backend="emulated") as sharded:
        check_outputs(sharded, 1.0)
        for c in ({"json": SCHEMA, **COMPACT}, {"regex": REGEX}):
            assert texts(sharded, c) == texts(llm, c)  # greedy: the same tokens as tp=1


def test_grammar_mask_with_a_real_tokenizer():
    tokenizer = byte_level_tokenizer(321)
    backend = GrammarBackend.from_tokenizer(tokenizer, 330, [tokenizer.eos_token_id])  # model vocab > tokenizer's
    state = backend.matcher(StructuredOutputsParams(choice=["ab", "ac"]))
    allowed = state.allowed()
    assert allowed.shape == (330,) and allowed.nonzero().flatten().tolist() == [ord("a")]
    state.advance([ord("a")])
    assert state.allowed().nonzero().flatten().tolist() == [ord("b"), ord("c")]
    state.advance([ord("c")])
    assert state.allowed().nonzero().flatten().tolist() == [tokenizer.eos_token_id]
    assert not state.allowed()[321:].any()


def test_bad_constraints_are_refused_with_the_reason(llm):
    assert choice_grammar(['a"b']) == 'root ::= "a\\"b"'
    with pytest.raises(GrammarError, match=r"structured_outputs.regex cannot be compiled"):
        llm.generate(["x"], SamplingParams(max_tokens=4, structured_outputs={"regex": "(ab"}))
    with pytest.raises(GrammarError, match=r"structured_outputs.grammar cannot be compiled"):
        llm.generate(["x"], SamplingParams(max_tokens=4, structured_outputs={"grammar": "root ::= undefined_rule"}))
    with pytest.raises(ValueError, match=r"exactly one of"):
        SamplingParams(structured_outputs={"regex": "a", "choice": ["a"]})
    with pytest.raises(ValueError, match=r"structural_tag must have \"format\" .* or \"structures\" and \"triggers\""):
        SamplingParams(structured_outputs={"structural_tag": "{}"})
    with pytest.raises(ValueError, match=r"\"triggers\" must be a non-empty list"):
        SamplingParams(structured_outputs={"structural_tag": json.dumps({**LEGACY_TAG, "triggers": []})})
    with pytest.raises(GrammarError, match=r"structured_outputs.structural_tag cannot be compiled"):
        llm.generate(["x"], SamplingParams(max_tokens=4, structured_outputs={"structural_tag": json.dumps(
            {"type": "structural_tag", "format": {"type": "no_such_format"}})}))
    with pytest.raises(ValueError, match=r"needs json_schema"):
        ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], response_format={"type": "json_schema"})


def test_grammar_after_a_start_token_leaves_what_precedes_it_free():
    tokenizer = byte_level_tokenizer(321)
    end = tokenizer.eos_token_id - 1  # a special token standing for </think>
    backend = GrammarBackend.from_tokenizer(tokenizer, 321, [tokenizer.eos_token_id])
    state = backend.matcher(StructuredOutputsParams(choice=["ab"]), after_token=end)
    assert state.allowed().all()
    rows = torch.zeros(4, 321, dtype=torch.float64)
    masked, kept = state.mask_verify_rows(rows, [ord("z"), end, ord("b")])  # "b" is refused right after </think>
    assert kept == [ord("z"), end] and masked.shape == (3, 321)
    assert torch.isfinite(masked[0]).all() and torch.isfinite(masked[1]).all()
    assert torch.isfinite(masked[2]).nonzero().flatten().tolist() == [ord("a")]
    assert state.allowed().all()  # rolled back: still waiting for the start token
    state.advance([ord("q"), end, ord("a")])
    assert state.allowed().nonzero().flatten().tolist() == [ord("b")]


def test_llm_grammar_starts_after_its_token(model_dir, llm):
    end = 300  # a filler token: pushed first, the JSON follows it; never emitted, nothing is constrained
    first = SamplingParams(temperature=0, max_tokens=80, structured_outputs={"json": SCHEMA, **COMPACT},
                           structured_outputs_after_token=end, logit_bias={end: 100})
    out = llm.generate(["hello"], first)[0].outputs[0]
    assert out.token_ids[0] == end
    jsonschema.validate(loads(llm.get_tokenizer().decode(out.token_ids[1:-1])), SCHEMA)
    never = SamplingParams(temperature=0, max_tokens=24, structured_outputs={"json": SCHEMA, **COMPACT},
                           structured_outputs_after_token=end, logit_bias={end: -100})
    plain = SamplingParams(temperature=0, max_tokens=24, logit_bias={end: -100})
    assert llm.generate(["hello"], never)[0].outputs[0].text == llm.generate(["hello"], plain)[0].outputs[0].text


def test_preempted_requests_keep_their_grammar_state(model_dir, llm):
    """A cache of 24 blocks (96 tokens) for four requests of up to 81: the youngest are preempted and
    recompute ``prompt + output``; their matchers are untouched, so the outputs are those of the
    roomy engine, token for token."""
    constraint = {"json": SCHEMA, **COMPACT}
    prompts = ["a", "bb", "ccc", "dddd"]
    roomy = texts(llm, constraint, temperature=1.0, prompts=prompts)
    with LLM(model_dir, dtype="float64", max_model_len=128, block_size=4, num_gpu_blocks_override=24,
             max_num_seqs=4) as small:
        assert texts(small, constraint, temperature=1.0, prompts=prompts) == roomy
        assert small.engine.report()["scheduler"]["preemptions"] > 0


TAGGED = {"type": "structural_tag", "format": {"type": "tag", "begin": "<f>", "end": "</f>",
                                                "content": {"type": "regex", "pattern": "[a-c]{2,4}"}}}
OBJECT_A = {"type": "object", "properties": {"a": {"enum": [1]}}, "required": ["a"], "additionalProperties": False}
LEGACY_TAG = {"structures": [{"begin": "<f>", "schema": OBJECT_A, "end": "</f>"}], "triggers": ["<f"]}


def test_structural_tag_masks_with_a_real_tokenizer():
    """vLLM's older shape: free text until the trigger, then the structure's schema; the newer
    shape (xgrammar's format): exactly ``<f>``, the content, ``</f>``."""
    tokenizer = byte_level_tokenizer(321)
    backend = GrammarBackend.from_tokenizer(tokenizer, 321, [tokenizer.eos_token_id])
    legacy = backend.matcher(StructuredOutputsParams(structural_tag=json.dumps(LEGACY_TAG)))
    assert legacy.allowed().all()  # nothing triggered yet
    legacy.advance([ord(c) for c in "hi <f>"])
    assert legacy.allowed().nonzero().flatten().tolist() == [ord("{")]
    tagged = backend.matcher(StructuredOutputsParams(structural_tag=json.dumps(TAGGED)))
    assert tagged.allowed().nonzero().flatten().tolist() == [ord("<")]
    tagged.advance([ord(c) for c in "<f>"])
    assert tagged.allowed().nonzero().flatten().tolist() == [ord("a"), ord("b"), ord("c")]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_llm_output_follows_a_structural_tag(llm, temperature):
    for text, reason, _ in texts(llm, {"structural_tag": json.dumps(TAGGED)}, temperature):
        assert reason == "stop" and re.fullmatch(r"<f>[a-c]{2,4}</f>", text), text


def test_response_format_structural_tag_is_vllms():
    """``response_format: {"type": "structural_tag", ...}`` in either shape becomes the request's
    ``structured_outputs.structural_tag`` (the object's JSON text, as vLLM passes it on)."""
    messages = [{"role": "user", "content": "hi"}]
    for shape in (TAGGED, {"type": "structural_tag", **LEGACY_TAG}):
        body = ChatCompletionRequest(messages=messages, response_format=shape)
        assert json.loads(body.sampling_params(8).structured_outputs.structural_tag) == shape
    with pytest.raises(ValueError, match=r"\"structures\" must be a non-empty list"):
        ChatCompletionRequest(messages=messages, response_format={"type": "structural_tag", "structures": [{}],
                                                                  "triggers": ["<f"]})


def test_disable_additional_properties_closes_every_object_schema():
    """vLLM's ``disable_additional_properties``: objects with properties and no
    ``additionalProperties`` of their own are closed at any depth; an explicit one is kept.
    jsonschema (independent of the rewrite) then refuses an extra key the original allowed."""
    from dcpgraph.runtime.structured_outputs import without_additional_properties

    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}},
                                               "c": {"type": "array", "items": {"type": "object",
                                                                                "patternProperties": {"^x": {}}}},
                                               "d": {"type": "object", "properties": {}, "additionalProperties": True}}}
    closed = without_additional_properties(json.dumps(schema))
    assert closed["additionalProperties"] is False and closed["properties"]["a"]["additionalProperties"] is False
    assert closed["properties"]["c"]["items"]["additionalProperties"] is False
    assert closed["properties"]["d"]["additionalProperties"] is True and "additionalProperties" not in schema
    extra = {"a": {"b": 1, "z": 2}}
    jsonschema.validate(extra, schema)
    with pytest.raises(jsonschema.ValidationError, match="Additional properties are not allowed"):
        jsonschema.validate(extra, closed)
    params = StructuredOutputsParams.from_json({"json": schema, "disable_additional_properties": True})
    assert params.disable_additional_properties and params.to_json()["disable_additional_properties"] is True
    with pytest.raises(ValueError, match="whitespace_pattern is not supported"):
        StructuredOutputsParams.from_json({"json": schema, "whitespace_pattern": " "})
