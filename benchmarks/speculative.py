"""Speculative decoding: tokens per step and decode throughput against k, per method.

One run, greedy (so every configuration's tokens must equal the baseline's, asserted), on a
4-layer Llama-shaped model (hidden 256, fp32, tp=1), ``--requests`` prompts decoding ``--new``
tokens each, all admitted in the first step:

* ``baseline``: no speculation (k = 0);
* ``ngram``: prompt lookup, on prompts that repeat a random phrase (what lookup is for);
* ``draft_model/layer_skip``: a 1-layer draft made of the target's embedding, first layer, final
  norm and head (a self-speculative "layer skip" draft: cheap, partly agreeing);
* ``draft_model/oracle``: the target itself as draft (every draft accepted: the mechanism's upper
  bound on tokens per step, and its cost when the draft is as expensive as the target).

* ``mtp/…``: DeepSeek-V3's multi-token prediction, on a tiny DeepSeek-V3 checkpoint (2 layers, fp32)
  saved with MTP weights, against its own ``mtp baseline``. Random MTP weights almost never agree
  with the target, so the checkpoint is rewritten by
  :func:`~dcpgraph.testing.checkpoints.make_mtp_predictable`: ``mtp/eps=0`` predicts the target
  exactly (every draft accepted: the upper bound), ``mtp/eps=0.01`` makes both depend a little on
  context (partial acceptance). Neither is a trained MTP head.

Per configuration: ``tokens_per_step`` (mean accepted length: tokens a verified row emits per
target step, 1 without speculation), ``target_steps`` and ``decode_tokens_per_s`` (generated
tokens over the wall time of the whole generate, drafting included; the median of ``--reps``
runs, all configurations interleaved rep by rep) with the baseline's as ``baseline``. Random weights agree with a truncated draft less than trained ones do, so the
layer-skip row is a floor, not a forecast.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time

import common  # noqa: F401 - puts the checkout on sys.path
import torch

import dcpgraph
from dcpgraph.models import tiny_config

NAME = "speculative"


def target_model(layers: int):
    import transformers as tf

    config = tiny_config("llama", layers=layers)
    config.hidden_size, config.intermediate_size = 256, 512
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(config).float().eval()


def layer_skip_draft(target):
    draft = copy.deepcopy(target)
    draft.model.layers = draft.model.layers[:1]
    draft.config.num_hidden_layers = 1
    return draft


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        phrase = torch.randint(3, 250, (4 + i % 3,), generator=gen).tolist()
        out.append(phrase * 3 + phrase[:2])
    return out


def mtp_programs(tmp: str) -> dict[str, object]:
    """Loaded DeepSeek-V3 tiny programs with MTP weights, per predictability ``eps``."""
    from dcpgraph.checkpoints.loader import load_program
    from dcpgraph.testing.checkpoints import make_mtp_predictable, save_tiny_checkpoint

    out = {}
    for eps in (0.0, 0.01):
        path = save_tiny_checkpoint(f"{tmp}/eps{eps}", "deepseek_v3", dtype=torch.float32, mtp_weights=True)
        make_mtp_predictable(path, eps, hidden_part=0.3 if eps else 0.0, mtp_attention=0.3 if eps else None)
        out[f"eps={eps:g}"] = load_program(path, "float32")
    return out


def build(program, work, spec):
    engine = dcpgraph.compile(program, block_size=16, max_num_seqs=len(work), max_num_batched_tokens=1024,
                              speculative_config=spec)
    engine.generate(work[:1], 2)  # warm up
    return engine


def measure(engine, work, new: int) -> dict:
    """One timed generate; the acceptance figures are this call's (counters differenced)."""
    before, steps0 = engine.report()["speculative"], engine.steps
    start = time.perf_counter()
    tokens = engine.generate(work, new)
    wall = time.perf_counter() - start
    after = engine.report()["speculative"]
    rows = after["verified_rows"] - before["verified_rows"]
    drafted, accepted = after["drafted"] - before["drafted"], after["accepted"] - before["accepted"]
    return {"tokens": tokens, "wall": wall, "steps": engine.steps - steps0,
            "per_step": 1 + accepted / rows if rows else 1.0, "acceptance": accepted / drafted if drafted else None,
            "generated": sum(len(t) for t in tokens)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="k in {1, 3}, 4 requests of 24 tokens, 2 reps")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--new", type=int, default=48)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    ks = (1, 3) if args.quick else (1, 2, 3, 4)
    n, new = (4, 24) if args.quick else (args.requests, args.new)
    if args.quick:
        args.reps = 2
    target = target_model(4)
    program = dcpgraph.trace(target)
    drafts = {"layer_skip": dcpgraph.trace(layer_skip_draft(target)), "oracle": program}
    work = prompts(n)
    configs = {"baseline": None}
    for k in ks:
        configs[f"ngram k={k}"] = {"method": "ngram", "num_speculative_tokens": k}
        for name, draft in drafts.items():
            configs[f"draft_model/{name} k={k}"] = {"method": "draft_model", "num_speculative_tokens": k, "model": draft}
    engines = {label: build(program, work, spec) for label, spec in configs.items()}
    import tempfile

    checkpoints = tempfile.TemporaryDirectory()  # weights are read lazily, per rank: kept until the end
    mtp = mtp_programs(checkpoints.name)
    mtp_work = [[t % 200 + 3 for t in p] for p in work]  # within the tiny checkpoint's vocabulary
    groups = {label: "llama" for label in engines}
    for name, mtp_program in mtp.items():
        engines[f"mtp baseline {name}"] = build(mtp_program, mtp_work, None)
        groups[f"mtp baseline {name}"] = f"mtp baseline {name}"
        for k in ks:
            label = f"mtp/{name} k={k}"
            engines[label] = build(mtp_program, mtp_work, {"method": "mtp", "num_speculative_tokens": k})
            groups[label] = f"mtp baseline {name}"
    runs = {label: [] for label in engines}
    for _ in range(args.reps):  # variants interleaved rep by rep: the machine is shared and noisy
        for label, engine in engines.items():
            runs[label].append(measure(engine, work if groups[label] == "llama" else mtp_work, new))
    config = f"llama 4x256 fp32 tp=1 requests={n} new={new} greedy reps={args.reps} {common.load_note()}"
    records = []
    for label, rs in runs.items():
        base = runs["baseline" if groups[label] == "llama" else groups[label]]
        base_tokens, base_steps = base[0]["tokens"], base[0]["steps"]
        base_tok_s = statistics.median(r["generated"] / r["wall"] for r in base)
        assert all(r["tokens"] == base_tokens for r in rs), f"{label} changed greedy tokens"
        tok_s = statistics.median(r["generated"] / r["wall"] for r in rs)
        r = rs[0]
        acc = "n/a" if r["acceptance"] is None else f"{r['acceptance']:.2f}"
        print(f"{label:28s}: {r['per_step']:.2f} tokens/step, acceptance {acc}, {r['steps']} steps, "
              f"{tok_s:.1f} tok/s (x{tok_s / base_tok_s:.2f})")
        cfg = f"{config} {label}" if groups[label] == "llama" else f"deepseek_v3 tiny+MTP fp32 tp=1 {config.split(' ', 4)[-1]} {label}"
        records.append(common.record(NAME, cfg, "tokens_per_step", r["per_step"], "tokens"))
        records.append(common.record(NAME, cfg, "target_steps", r["steps"], "steps", baseline=base_steps))
        records.append(common.record(NAME, cfg, "decode_tokens_per_s", tok_s, "tok/s", baseline=base_tok_s))
    print(f"wrote {common.write(NAME, records)}")
    checkpoints.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
