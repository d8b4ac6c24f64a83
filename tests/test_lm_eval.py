"""lm-eval's ``local-completions`` client against ``dcpgraph serve`` (slow tier: a server process).

Two local tasks over jsonl files written here (``dataset_path: json``, no hub download): a
multiple-choice task (lm-eval's loglikelihood requests: ``echo: true, logprobs: 1, max_tokens: 1``
over the context + continuation tokens) and a ``generate_until`` task. Both complete with a score;
the independent references are HF's own forward on the same fp64 weights (each choice's
loglikelihood, summed ``log_softmax`` over the continuation tokens, split as lm-eval splits them)
and HF's greedy ``generate`` (the generated text up to the stop string).
"""

from __future__ import annotations

import json

import pytest
import torch

from dcpgraph.checkpoints.model_dir import load_model, load_tokenizer
from dcpgraph.testing.server import running_server

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is in the test extra: pip install -e '.[test]'")

QUESTIONS = [
    {"question": "The sky is", "choices": ["blue", "green", "loud"], "label": 0},
    {"question": "Two plus two is", "choices": ["four", "five"], "label": 0},
    {"question": "Water is", "choices": ["dry", "wet", "a cat", "old"], "label": 1},
]
GENERATE = [{"question": "Once upon a time", "answer": "there"}, {"question": "Hello,", "answer": "world"}]


def write_tasks(root) -> str:
    """Two task YAMLs and their jsonl files under ``root``; returns the include path."""
    mc, gen = root / "mc.jsonl", root / "gen.jsonl"
    mc.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    gen.write_text("".join(json.dumps(q) + "\n" for q in GENERATE))
    (root / "dcp_mc.yaml").write_text(f"""task: dcp_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {mc}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
""")
    (root / "dcp_gen.yaml").write_text(f"""task: dcp_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {gen}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
""")
    return str(root)


def hf_loglikelihood(model, tokenizer, context: str, continuation: str) -> float:
    """lm-eval's split (trailing context spaces move to the continuation; the continuation's tokens
    are the whole text's after the context's), scored by HF's forward."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
    ctx = tokenizer(context, add_special_tokens=False).input_ids
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([whole])).logits[0].double(), -1)
    return sum(float(logp[i - 1, whole[i]]) for i in range(len(ctx), len(whole)))


def hf_greedy_text(model, tokenizer, prompt: str, max_new: int) -> str:
    ids = torch.tensor([tokenizer(prompt, add_special_tokens=False).input_ids])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                             pad_token_id=0)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).split("\n")[0]


@pytest.mark.slow
def test_lm_eval_local_completions_scores_and_equals_hf(checkpoints, tmp_path, monkeypatch):
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = checkpoints["qwen3"]
    include = write_tasks(tmp_path)
    args = ("--dtype", "float64", "--block-size", "4", "--max-model-len", "256", "--served-model-name", "tiny")
    with running_server(path, *args, log_path=str(tmp_path / "server.log")) as server:
        model_args = (f"model=tiny,base_url={server.url}/v1/completions,tokenizer_backend=huggingface,"
                      f"tokenizer={path},max_length=256,num_concurrent=1,max_retries=1")
        results = lm_eval.simple_evaluate(model="local-completions", model_args=model_args,
                                          tasks=["dcp_mc", "dcp_gen"], task_manager=TaskManager(include_path=include),
                                          log_samples=True, random_seed=0, numpy_random_seed=0, torch_random_seed=0,
                                          fewshot_random_seed=0)
    scores = results["results"]
    assert 0.0 <= scores["dcp_mc"]["acc,none"] <= 1.0 and 0.0 <= scores["dcp_gen"]["exact_match,none"] <= 1.0
    model, tokenizer = load_model(path, "float64"), load_tokenizer(path)
    samples = results["samples"]["dcp_mc"]
    assert len(samples) == len(QUESTIONS)
    for sample in samples:
        doc = sample["doc"]
        got = [float(r[0][0]) for r in sample["resps"]]
        want = [hf_loglikelihood(model, tokenizer, doc["question"], " " + c) for c in doc["choices"]]
        assert got == pytest.approx(want, abs=1e-6), (doc, got, want)
        assert sample["acc"] == float(max(range(len(want)), key=want.__getitem__) == doc["label"])
    for sample in results["samples"]["dcp_gen"]:
        assert sample["resps"][0][0] == hf_greedy_text(model, tokenizer, sample["doc"]["question"], 6)
