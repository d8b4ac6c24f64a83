"""A DeepSeek-V4 checkpoint directory as transformers' ``save_pretrained`` writes it: the released
checkpoint's names (``layers.{i}.attn.wkv``, ``ffn.experts.{e}.w1``, ``attn_sink``, ``hc_attn_fn``,
``ffn.gate.tid2eid``, ...), which transformers' conversion mapping renames with chained regular
expressions and per-expert merges when it loads. dcpgraph's loader finds every parameter and
buffer of the model under them (:mod:`dcpgraph.checkpoints.names`), and ``LLM(model=dir)`` gives
HF ``generate``'s greedy tokens."""

from __future__ import annotations

import dsv4_models
import pytest
import torch

PROMPTS = [list(dsv4_models.PROMPTS[3]), [7], [5, 9, 3, 17, 22, 40, 8, 1, 33, 12, 60]]
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from dcpgraph.testing.checkpoints import tiny_tokenizer

    model = dsv4_models.build(o_groups=4)
    path = tmp_path_factory.mktemp("v4")
    model.save_pretrained(path)
    tiny_tokenizer(96).save_pretrained(path)
    return model, str(path)


def test_every_v4_tensor_is_found_under_the_saved_names_with_its_values(saved):
    """The saved names are not the modules' (so a lookup by module name alone finds none of the
    attention's); every parameter and buffer resolves to a stored tensor (or a merge of per-expert
    ones) whose values are the model's own, and nothing stored is left unused."""
    from safetensors import safe_open

    from dcpgraph.checkpoints.files import weight_files
    from dcpgraph.checkpoints.loader import open_checkpoint

    model, path = saved
    stored = set()
    for name in weight_files(path):
        with safe_open(f"{path}/{name}", framework="pt") as handle:
            stored |= set(handle.keys())
    assert "model.layers.1.self_attn.kv_proj.weight" not in stored and "model.layers.1.attn.wkv.weight" in stored
    _, sources = open_checkpoint(path, "float64")
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    assert set(sources) == set(state)
    for name, tensor in state.items():
        assert torch.equal(sources[name].read(None).to(tensor.dtype), tensor), name


@pytest.mark.slow  # the meta trace of the loaded V4 (~15 s on 2 loaded cores) and HF's generate
def test_llm_on_a_v4_directory_gives_hf_greedy_tokens(saved):
    import dcpgraph
    from dcpgraph.testing.generation import hf_greedy

    model, path = saved
    want = [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]
    llm = dcpgraph.LLM(model=path, dtype="float64", block_size=4)
    assert llm.engine.generate(PROMPTS, NEW_TOKENS) == want
