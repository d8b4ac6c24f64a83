"""``load_format`` (vLLM's ``--load-format``): "dummy" builds the model from the config alone.

A model directory with its weight files removed still serves under "dummy"; the weights are
vLLM's dummy range, the same in every rank's slice (tp=2 emulated gives tp=1's tokens), and
"auto" on the same directory, or an unknown format, is refused by name.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from dcpgraph import LLM, SamplingParams
from dcpgraph.checkpoints.loader import load_program
from dcpgraph.checkpoints.tensor_sources import DUMMY_RANGE, Dummy
from dcpgraph.errors import ConfigError, DcpGraphError

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def config_only(checkpoints, tmp_path_factory):
    """The qwen3 checkpoint's directory without any weight file."""
    path = tmp_path_factory.mktemp("config_only") / "qwen3"
    shutil.copytree(checkpoints["qwen3"], path, ignore=shutil.ignore_patterns("*.safetensors*"))
    return str(path)


def test_dummy_weights_come_from_the_config_alone(config_only):
    program = load_program(config_only, "float32", "dummy")
    weights = program.state_reader(program, 0)
    assert weights and all(w.abs().max() <= DUMMY_RANGE for w in weights if w.is_floating_point() and w.dim() == 2)
    source = Dummy((6, 4), "model.layers.0.mlp.up_proj.weight")  # the same values in every process
    assert torch.equal(source.read(None), Dummy((6, 4), source.name).read(None))
    assert torch.equal(source.read(0, 2, 4), source.read(None)[2:4])
    assert not torch.equal(source.read(None), Dummy((6, 4), "another").read(None))


def test_dummy_llm_generates_and_ranks_share_the_weights(config_only):
    with LLM(model=config_only, dtype="float64", block_size=4, load_format="dummy") as llm:
        one = llm.generate("hello world", GREEDY)[0].outputs[0].token_ids
    with LLM(model=config_only, dtype="float64", block_size=4, load_format="dummy", tensor_parallel_size=2,
             decode_context_parallel_size=2, distributed_executor_backend="emulated") as llm:
        two = llm.generate("hello world", GREEDY)[0].outputs[0].token_ids
    assert len(one) == 4 and one == two


def test_load_formats_refused_by_name(config_only):
    with pytest.raises(ConfigError, match=r"load_format must be one of \['auto', 'safetensors', 'dummy'\]"):
        LLM(model=config_only, load_format="pt")
    with pytest.raises(DcpGraphError, match="safetensors"):
        LLM(model=config_only, load_format="auto")  # no weight file: today's behaviour, refused
