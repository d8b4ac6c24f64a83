"""A stand-in for a CUDA graph that runs on the CPU, so :class:`~dcpgraph.backends.device_graphs.DeviceGraph`'s
logic (static buffers, copy-in, address checks, replay counts) is tested against the plain call
without a GPU.

:class:`HostReplayCapture` behaves as a CUDA graph does where that logic can go wrong: capture runs
nothing and keeps the buffers it was given; replay runs the recorded function on *those* buffers
(never on the step's own tensors) and writes the results into output tensors allocated at the
first replay, returning the same output tensors every time. So a per-step input the wrapper forgot
to copy in is read stale, and an output the wrapper forgot to clone is overwritten by the next
replay, as on a GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_flatten


class HostReplayCapture:
    def __init__(self):
        self.fn: Callable | None = None
        self.args: Sequence[Any] = ()
        self.outputs = None

    def capture(self, fn: Callable, args: Sequence[Any]) -> None:
        self.fn, self.args = fn, args

    def replay(self) -> Any:
        fresh = self.fn(*self.args)
        if self.outputs is None:
            self.outputs = fresh
            return self.outputs
        for static, new in zip(tree_flatten(self.outputs)[0], tree_flatten(fresh)[0]):
            if isinstance(static, torch.Tensor):
                static.copy_(new)
        return self.outputs


class HostReplayCaptures:
    """The capture maker (what :func:`~dcpgraph.backends.device_graphs.device_graphs_for` returns on CUDA);
    keeps every capture it made."""

    kind = "host-replay"

    def __init__(self):
        self.made: list[HostReplayCapture] = []

    def __call__(self) -> HostReplayCapture:
        self.made.append(HostReplayCapture())
        return self.made[-1]


def serve_arrivals(engine, arrivals: dict[int, list[list[int]]], max_tokens: int) -> list[list[int]]:
    """A serving-like run: ``arrivals[step]``'s prompts are added at that step while others run, so
    decode batches of several sizes (several buckets) occur; each request's tokens, in arrival order."""
    tokens: dict[int, list[int]] = {}
    step = 0
    while step <= max(arrivals) or engine.scheduler.has_work():
        for prompt in arrivals.get(step, []):
            tokens[engine.add_request(prompt, max_tokens)] = []
        for rid, token, _ in engine.step():
            tokens[rid].append(token)
        step += 1
    return [tokens[r] for r in sorted(tokens)]


def replays_and_decode_steps(report: dict) -> tuple[dict[str, int], dict[str, int]]:
    """From ``Engine.report()``: each captured graph's replays, and the steps the model runner ran
    on each decode bucket (counted by the runner, not by the capture wrapper)."""
    replays = {name: status["device_graph"]["replays"] for name, status in report["graphs"].items()
               if "device_graph" in status}
    steps = {name: n for name, n in report["graph_steps"].items() if name.startswith("decode[")}
    return replays, steps
