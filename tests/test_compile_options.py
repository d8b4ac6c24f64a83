"""``dcpgraph.compile`` checks every option before any work: no facts read, no trace, no pass.

The front ends, ``dcpgraph.trace``, ``facts_of`` and ``compile_program`` are replaced by functions
that fail the test if called, so a bad option noticed only after some work shows up as
"work started" instead of the expected error.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import dcpgraph
from dcpgraph import ConfigError
from dcpgraph.models import build_model
from dcpgraph.options import VALID_OPTIONS, compile_options
from dcpgraph.program import Program


class TinyLM(nn.Module):
    """A plain module: its facts can only be read by tracing it."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.head = nn.Linear(16, 32)

    def forward(self, input_ids, position_ids):
        return self.head(self.emb(input_ids))


@pytest.fixture
def no_work(monkeypatch):
    import dcpgraph.api as api
    import dcpgraph.frontends.fx as fx
    import dcpgraph.frontends.hf as hf
    import dcpgraph.passes.pipeline as pipeline

    def forbidden(*args, **kwargs):
        raise AssertionError("work started before the options were checked")

    for module, name in ((hf, "trace_hf"), (hf, "model_facts"), (fx, "trace_module"), (api, "trace"),
                         (api, "facts_of"), (pipeline, "compile_program")):
        monkeypatch.setattr(module, name, forbidden)


BAD = [
    ({"capture_limit": -1}, ConfigError, r"capture_limit must be an int >= 0, got -1"),
    ({"max_num_seqs": 0}, ConfigError, r"max_num_seqs must be None or an int >= 1"),
    ({"max_num_batched_tokens": "256"}, ConfigError, r"max_num_batched_tokens must be None or an int >= 1, got '256'"),
    ({"block_size": 0}, ConfigError, r"block_size must be an int >= 1"),
    ({"interleave": True}, ConfigError, r"interleave must be an int >= 1, got True"),
    ({"max_model_len": 0}, ConfigError, r"max_model_len must be None or an int >= 1"),
    ({"num_blocks": -3}, ConfigError, r"num_blocks must be None or an int >= 1"),
    ({"num_blocks": 4, "kv_cache_tokens": 64}, ConfigError,
     r"give at most one of \['num_blocks', 'kv_cache_tokens', 'kv_cache_bytes_per_rank'\]"),
    ({"verify": "yes"}, ConfigError, r"verify must be True or False"),
    ({"enable_prefix_caching": 1}, ConfigError, r"enable_prefix_caching must be None \(on where supported\), True or False"),
    ({"comm": "ring"}, ConfigError, r"comm must be 'auto', 'a2a', 'ag_rs' or 'ag', got 'ring'"),
    ({"executor": "gpu"}, ConfigError, r"executor must be 'auto', 'emulated' or 'distributed'"),
    ({"backend": "tpu-magic"}, ConfigError, r"unknown backend 'tpu-magic'; choose from"),
    ({"plan": ["colwise"]}, ConfigError, r"plan must be None or a dict"),
    ({"fuse_new_tokens": 1}, ConfigError, r"fuse_new_tokens must be None \(by backend\), True or False, got 1"),
    ({"fuse_new_tokens": True, "backend": "torchair"}, ConfigError,
     r"fuse_new_tokens=True cannot lower on backend 'torchair': its paged attention takes no causal bound"),
    ({"capture_limt": 4}, TypeError, r"unknown options: \['capture_limt'\]; compile takes \[.*'capture_limit'"),
    ({"tp": 0}, ConfigError, r"tp must be a positive int"),
]


@pytest.mark.parametrize(("kw", "error", "message"), BAD, ids=[next(iter(kw)) + str(i) for i, (kw, _, _) in enumerate(BAD)])
@pytest.mark.parametrize("model", ["hf", "plain"])
def test_bad_option_fails_before_any_work(no_work, model, kw, error, message):
    module = build_model("llama") if model == "hf" else TinyLM()
    with pytest.raises(error, match=message):
        dcpgraph.compile(module, **kw)


def test_a_program_is_not_compiled_either(no_work):
    program = Program.__new__(Program)  # never looked at: the options fail first
    with pytest.raises(ConfigError, match="capture_limit"):
        dcpgraph.compile(program, capture_limit=-5)
    with pytest.raises(TypeError, match="takes an nn.Module or a Program"):
        dcpgraph.compile("llama")


def test_defaults_and_every_valid_name():
    opts = compile_options()
    assert set(opts) == set(VALID_OPTIONS)
    assert (opts["capture_limit"], opts["speculative_config"], opts["max_num_seqs"], opts["block_size"]) == (32, None, 8, 16)
    assert opts["verify"] is True and opts["plan"] is None and opts["num_blocks"] is None
    assert compile_options(num_blocks=torch.tensor(3).item(), capture_limit=0)["num_blocks"] == 3
    # the new tokens join the paged read except on the Ascend backends (FIAS takes no causal bound)
    assert opts["fuse_new_tokens"] is True
    assert compile_options(backend="torchair")["fuse_new_tokens"] is False
    assert compile_options(backend="npugraph_ex")["fuse_new_tokens"] is False
    assert compile_options(fuse_new_tokens=False)["fuse_new_tokens"] is False


# -- one spelling per option: the older ones warn, name the new one and still work -----------------
def test_max_batched_tokens_is_deprecated_for_max_num_batched_tokens():
    with pytest.warns(DeprecationWarning, match="max_batched_tokens is deprecated: use max_num_batched_tokens"):
        opts = compile_options(max_batched_tokens=12)
    assert opts["max_num_batched_tokens"] == 12 and "max_batched_tokens" not in opts
    with pytest.raises(ConfigError, match="max_num_batched_tokens or its deprecated spelling max_batched_tokens, not both"), \
            pytest.warns(DeprecationWarning):
        compile_options(max_batched_tokens=12, max_num_batched_tokens=12)
    with pytest.raises(ConfigError, match="max_num_batched_tokens must be None or an int >= 1, got '8'"), \
            pytest.warns(DeprecationWarning):
        compile_options(max_batched_tokens="8")


def test_speculative_tokens_is_deprecated_for_speculative_config():
    new = r'speculative_config=\{"method": "ngram", "num_speculative_tokens": 3\}'
    with pytest.warns(DeprecationWarning, match=f"speculative_tokens=3 is deprecated: use {new}"):
        opts = compile_options(speculative_tokens=3)
    assert opts["speculative_config"] == compile_options(
        speculative_config={"method": "ngram", "num_speculative_tokens": 3})["speculative_config"]
    assert "speculative_tokens" not in opts
    with pytest.warns(DeprecationWarning, match="speculative_tokens=0"):
        assert compile_options(speculative_tokens=0)["speculative_config"] is None
    for bad, message in ((-2, r"speculative_tokens must be an int >= 0, got -2"),
                         (1.5, r"speculative_tokens must be an int >= 0, got 1.5")):
        with pytest.raises(ConfigError, match=message), pytest.warns(DeprecationWarning):
            compile_options(speculative_tokens=bad)
    with pytest.raises(ConfigError, match="not both"), pytest.warns(DeprecationWarning):
        compile_options(speculative_tokens=0, speculative_config={"method": "ngram", "num_speculative_tokens": 2})


@pytest.mark.parametrize("model", ["hf", "plain"])
def test_deprecated_spellings_fail_bad_values_before_any_work(no_work, model):
    module = build_model("llama") if model == "hf" else TinyLM()
    with pytest.raises(ConfigError, match="speculative_tokens must be an int >= 0"), pytest.warns(DeprecationWarning):
        dcpgraph.compile(module, speculative_tokens=-2)


def test_the_warning_points_at_the_callers_line():
    """The warning names the line that called ``dcpgraph.compile`` (here: ``compile_options``),
    not a line inside dcpgraph, so ``-W error::DeprecationWarning`` users find their call."""
    with pytest.warns(DeprecationWarning) as caught:
        compile_options(max_batched_tokens=4)
    assert [w.filename for w in caught] == [__file__]


def test_the_deprecated_spellings_still_compile_and_generate():
    program = dcpgraph.trace(build_model("llama", dtype=torch.float64))
    prompts = [[5, 6, 7, 8, 9, 10, 11], [3, 4]]
    new = dcpgraph.compile(program, block_size=4, max_num_batched_tokens=4,
                           speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.warns(DeprecationWarning) as caught:
        old = dcpgraph.compile(program, block_size=4, max_batched_tokens=4, speculative_tokens=2)
    assert sorted(str(w.message).split(" ")[0] for w in caught) == ["max_batched_tokens", "speculative_tokens=2"]
    assert all(w.filename == __file__ for w in caught)
    assert old.report()["speculative"] == new.report()["speculative"]
    assert old.scheduler.max_batched_tokens == new.scheduler.max_batched_tokens == 4
    assert old.generate(prompts, 5) == new.generate(prompts, 5)
