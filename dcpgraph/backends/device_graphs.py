"""Device graphs: each static-shape bucket (decode, and speculative verification) captured once as
a CUDA graph and replayed every step, so a decode step costs one graph launch instead of one
launch per kernel (what dominates small-batch decode on a GPU; vLLM's ``cudagraph_mode``
``FULL_DECODE_ONLY``). The mixed (prefill/dynamic-shape) graph is never captured.

When: a rank on a ``cuda`` device, a compiling backend (not ``eager``, not ``--enforce-eager``),
graph mode on (``capture_limit > 0``: there are buckets), ``cudagraph_mode="FULL_DECODE_ONLY"``
(the default; ``"NONE"``, vLLM's spelling, keeps the compiled buckets and captures nothing).
On the CPU nothing is wrapped: the compiled buckets are called exactly as without this module.
On Ascend the backend is the device graph: ``npugraph_ex`` captures aclgraphs of each static
shape and ``torchair``'s GE mode runs each bucket as one GE graph (:mod:`.torchair`), so nothing
is wrapped there either.

How (:class:`DeviceGraph`, around the bucket's compiled callable): dcpgraph captures with
``torch.cuda.CUDAGraph`` itself rather than asking inductor for its CUDA-graph trees
(``mode="reduce-overhead"``), because a dcpgraph program takes its weights and KV caches as graph
*inputs*, not parameters:

* cudagraph trees copy every input that is neither a parameter nor marked static into its own
  buffer at each replay (the whole KV cache, every step) and refuse to capture a graph that
  mutates such an input (the KV writes); here the split is known from the program's input kinds:
  weights, KV caches and recurrent-state pools (:data:`STATIC_KINDS`) are allocated once and never
  move, so the graph reads and writes them at their addresses, and only the per-step inputs
  (token ids, positions, lengths, block tables, slots) are copied into static buffers;
* it works for every compiling backend (inductor, ``aot_eager``, a user callable), counts its
  replays, and a capture that fails (an op that synchronises with the host, say) leaves that
  bucket running its compiled code uncaptured, with the reason in ``Engine.report()``;
* the logic (copy-in, address checks, bookkeeping) runs on the CPU with a stand-in capture
  (:mod:`dcpgraph.testing.device_graphs`), against the plain call.

Invariants: the first call of a bucket (the start-up capture run of :mod:`dcpgraph.runtime.capture`)
runs the compiled callable for real (compilation and warm-up) and then captures it; capture runs no
kernel, so the step's KV or state writes happen exactly once. A later call replays iff every
static input is the tensor captured (same address) and every per-step input has the captured
shape, dtype and device; otherwise it runs the compiled callable (``uncaptured_calls``). Outputs
are cloned after each replay: a replay overwrites the graph's output buffers, and the engine keeps
hidden states (MTP) across steps. All buckets of one program share one memory pool (vLLM does
the same): only one graph runs at a time and each graph's outputs stay allocated.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch.utils._pytree import tree_map

from ..program import CACHE, RECURRENT, STATE_KINDS

CUDAGRAPH_MODES = ("FULL_DECODE_ONLY", "NONE")  # vLLM's names; its PIECEWISE/FULL modes capture mixed steps
STATIC_KINDS = (*STATE_KINDS, CACHE, RECURRENT)  # inputs at fixed addresses: never copied into a buffer


class GraphCapture(Protocol):
    """One captured graph: :meth:`capture` records ``fn(*args)`` (running nothing), :meth:`replay`
    runs what was recorded on the same tensors and returns the outputs."""

    def capture(self, fn: Callable, args: Sequence[Any]) -> None: ...

    def replay(self) -> Any: ...


class CudaGraphCapture:
    """``torch.cuda.CUDAGraph``: the outputs are the tensors allocated during capture, rewritten by
    each replay."""

    def __init__(self, pool=None):
        self.pool = pool
        self.graph = None
        self.outputs = None

    def capture(self, fn: Callable, args: Sequence[Any]) -> None:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = fn(*args)
        self.graph, self.outputs = graph, outputs

    def replay(self) -> Any:
        self.graph.replay()
        return self.outputs


class CudaCaptures:
    """Makes the captures of one program's buckets, all in one memory pool (made at the first
    capture, on the rank's current device)."""

    kind = "cuda"

    def __init__(self):
        self.pool = None

    def __call__(self) -> CudaGraphCapture:
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        return CudaGraphCapture(self.pool)


def device_graphs_for(device: torch.device | str, cudagraph_mode: str) -> Callable[[], GraphCapture] | None:
    """The capture maker for a program whose ranks run on ``device``, None where nothing is
    captured (the CPU, Ascend, ``cudagraph_mode="NONE"``). Whether the backend compiles at all
    (eager, ``enforce_eager``, the multi-rank emulator) is :class:`~dcpgraph.backends.CompiledGraphs`'
    decision: a graph that runs eagerly is never wrapped."""
    if cudagraph_mode not in CUDAGRAPH_MODES:
        raise ValueError(f"cudagraph_mode must be one of {CUDAGRAPH_MODES}, got {cudagraph_mode!r}")
    if torch.device(device).type != "cuda" or cudagraph_mode == "NONE":
        return None
    return CudaCaptures()


def static_inputs(program) -> frozenset[int]:
    """Positions of ``program``'s inputs that live at fixed addresses (weights, caches, state pools)."""
    return frozenset(i for i, spec in enumerate(program.inputs) if spec.kind in STATIC_KINDS)


class DeviceGraph:
    """A bucket's compiled callable ``fn``, captured at its first call and replayed after (see the
    module docstring). ``static``: positions of the inputs used in place; ``new_capture()``: an
    empty :class:`GraphCapture`. ``status`` is ``fn``'s (a FallbackGraph's) plus ``device_graph``:
    ``{"kind", "captured", "replays", "uncaptured_calls", "reason"}``."""

    def __init__(self, name: str, fn: Callable, static: frozenset[int], new_capture: Callable[[], GraphCapture]):
        self.name = name
        self.fn = fn
        self.static = static
        self.new_capture = new_capture
        self.capture: GraphCapture | None = None
        self.buffers: list[Any] = []
        self.graph_status = {"kind": getattr(new_capture, "kind", type(new_capture).__name__), "captured": False,
                             "replays": 0, "uncaptured_calls": 0, "reason": None}
        self._tried = False

    @property
    def status(self) -> dict[str, Any]:
        return {**getattr(self.fn, "status", {}), "device_graph": dict(self.graph_status)}

    def __call__(self, *args):
        if not self._tried:  # the real first step (compile, warm-up), then capture: no step runs twice
            self._tried = True
            outputs = self.fn(*args)
            self._capture(args)
            return outputs
        mismatch = self.capture is not None and self._mismatch(args)
        if self.capture is None or mismatch:
            if mismatch and self.graph_status["reason"] is None:
                self.graph_status["reason"] = mismatch
            self.graph_status["uncaptured_calls"] += 1
            return self.fn(*args)
        for i, buffer in enumerate(self.buffers):
            if i not in self.static and isinstance(buffer, torch.Tensor):
                buffer.copy_(args[i], non_blocking=True)
        outputs = self.capture.replay()
        self.graph_status["replays"] += 1
        return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, outputs)

    def _capture(self, args: Sequence[Any]) -> None:
        buffers = [a.clone() if i not in self.static and isinstance(a, torch.Tensor) else a
                   for i, a in enumerate(args)]
        capture = self.new_capture()
        try:
            capture.capture(self.fn, buffers)
        except Exception as err:  # noqa: BLE001 - any capture failure leaves the compiled code running
            reason = f"capture failed: {type(err).__name__}: {err}".splitlines()[0][:500]
            self.graph_status["reason"] = reason
            warnings.warn(f"dcpgraph: graph {self.name!r} runs uncaptured: {reason}", RuntimeWarning, stacklevel=3)
            return
        self.capture, self.buffers = capture, buffers
        self.graph_status["captured"] = True

    def _mismatch(self, args: Sequence[Any]) -> str | None:
        """Why ``args`` cannot be replayed with (None when they can)."""
        if len(args) != len(self.buffers):
            return f"{len(args)} inputs, captured with {len(self.buffers)}"
        for i, (arg, buffer) in enumerate(zip(args, self.buffers)):
            if not isinstance(buffer, torch.Tensor):
                if arg is not buffer:
                    return f"input {i} is not the captured object"
            elif i in self.static:
                if not isinstance(arg, torch.Tensor) or arg.data_ptr() != buffer.data_ptr():
                    return f"input {i} (weights, cache or state) moved since capture"
            elif (not isinstance(arg, torch.Tensor) or arg.shape != buffer.shape or arg.dtype != buffer.dtype
                  or arg.device != buffer.device):
                return f"input {i} has shape {tuple(getattr(arg, 'shape', ()))}, captured {tuple(buffer.shape)}"
        return None
