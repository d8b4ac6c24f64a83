"""Peak resident memory of one rank loading a checkpoint shard by shard, against the full weights.

For a Llama-shaped checkpoint written here (random fp32 weights, untied LM head), each case runs in
a fresh process: trace on the meta device (:func:`dcpgraph.checkpoints.loader.load_program`), compile
for ``tp`` (emulated executor, nothing read yet), reset the kernel's peak-RSS mark (``5`` into
``/proc/self/clear_refs``), then read rank 0's state (``program.local_state(0)``, what a worker's
executor does) and report the growth of the peak (``VmHWM``) over the resident set before the read,
with the bytes of the tensors the rank now holds. Expected: at tp=2 about half the weights plus
a constant (one tensor's pages are mapped while it is sliced); at tp=1 the whole weights.

    python3 benchmarks/loader_memory.py [--quick]

Writes ``benchmarks/results/loader_memory.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

FULL = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, vocab_size=4096)
QUICK = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=8, vocab_size=2048)


def write_checkpoint(path: str, dims: dict) -> int:
    """A random Llama checkpoint of ``dims`` at ``path``; returns its weight bytes."""
    import torch
    import transformers as tf

    config = tf.LlamaConfig(num_attention_heads=8, num_key_value_heads=4, head_dim=dims["hidden_size"] // 8,
                            tie_word_embeddings=False, max_position_embeddings=256, **dims)
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(path)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def measure(path: str, tp: int) -> dict:
    """In this process: load rank 0's state at ``tp``; peak RSS growth and held tensor bytes."""
    import torch

    from dcpgraph.checkpoints.loader import load_program
    from dcpgraph.mesh import Mesh
    from dcpgraph.passes.pipeline import compile_program

    torch.set_num_threads(1)
    program = load_program(path, "float32")
    # The pass pipeline only: an emulated executor would read every rank's state.
    compiled = compile_program(program, Mesh(tp, 1), block_size=16)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status_kib("VmRSS")
    state = compiled.local_state(0)
    for t in state:  # safetensors may hand out lazily mapped storage: touch every byte, as a forward does
        t.sum()
    peak = _status_kib("VmHWM")
    held = sum(t.numel() * t.element_size() for t in state)
    return {"tp": tp, "peak_growth_bytes": (peak - before) * 1024, "held_tensor_bytes": held}


def run_case(path: str, tp: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--measure", path, str(tp)], check=True,
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(quick: bool = False, path: str | None = None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = path or tmp
        weights = write_checkpoint(path, QUICK if quick else FULL)
        cases = [run_case(path, tp) for tp in (1, 2)]
    result = {"weight_bytes": weights, "cases": cases}
    for case in cases:
        case["peak_growth_over_weights"] = round(case["peak_growth_bytes"] / weights, 3)
        case["held_over_weights"] = round(case["held_tensor_bytes"] / weights, 3)
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--measure", nargs=2, metavar=("PATH", "TP"))
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure[0], int(args.measure[1]))))
        sys.exit(0)
    result = main(args.quick)
    os.makedirs("benchmarks/results", exist_ok=True)
    with open("benchmarks/results/loader_memory.json", "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))
