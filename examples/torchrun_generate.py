"""Run a DCP engine under torchrun: one process per TP rank, every rank gets the same tokens.

    torchrun --nproc-per-node 2 examples/torchrun_generate.py --tp 2 --dcp 2

With torch.distributed initialised and world size == tp, ``dcpgraph.compile`` picks the
distributed executor; each process runs its own rank of the same per-rank graph.
"""

import argparse

import torch
import torch.distributed as dist

import dcpgraph
from dcpgraph.models import build_model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen3")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--dcp", type=int, default=2)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    model = build_model(args.model, seed=0)  # same seed on every rank: same weights
    engine = dcpgraph.compile(model, tp=args.tp, dcp=args.dcp)
    tokens = engine.generate([[1, 2, 3, 4, 5], [7]], max_new_tokens=16)
    if dist.get_rank() == 0:
        print(engine.report()["executor"], tokens)
        print(engine.memory_report())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
