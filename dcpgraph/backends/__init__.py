"""Backends: turn a per-rank FX program into something that runs, with an eager fallback.

``backend=`` in :func:`dcpgraph.compile` accepts ``"auto"``, ``"eager"``, ``"inductor"``,
``"aot_eager"`` (dynamo + AOTAutograd, executed eagerly: inductor's guards without its codegen), ``"torchair"`` (Ascend GE graph mode), ``"npugraph_ex"`` (Ascend aclgraph capture), or a callable
with ``torch.compile``'s backend signature ``(GraphModule, example_inputs) -> callable``.
``"auto"`` picks torchair on Ascend when it imports, inductor on CUDA, eager on CPU.

Every non-eager backend is wrapped in :class:`~dcpgraph.backends.fallback.FallbackGraph`: an
exception while compiling **or during the first call** (GE compiles lazily) switches that graph
to eager for good, records the reason and warns once; results are identical to eager's because
the same GraphModule runs.

A program the torchair (GE) backend cannot lower as a whole (it holds dcpgraph ops with no GE
lowering rule: DeepSeek-V4's compressed ops) is decided eager **before** anything compiles, from
the rules table alone (:func:`dcpgraph.backends.npu.decide.ge_decision`): no graph is handed to
torchair, nothing warns per graph or step, and the reason naming the ops is in the report
(``eager_reason``) and, through :func:`backend_provenance`, in the program's provenance.

Where compiled code runs: the single-rank executor and the distributed executor call the
compiled callable. The multi-rank emulator interprets the FX graph node by node (it has to stop
at every collective), so it always runs eagerly; its report says so.

On a CUDA device each static-shape bucket's compiled callable is also captured as a CUDA graph and
replayed (:mod:`.device_graphs`, ``cudagraph_mode``); nothing changes elsewhere.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.fx

from ..program import Provenance
from .compile_log import CompileLog
from .registry import GE_FACTORY, available_backends, resolve_backend

log = logging.getLogger("dcpgraph")

__all__ = ["CompiledGraphs", "available_backends", "backend_provenance", "compile_backend", "resolve_backend",
           "use_compile_cache_dir"]


class CompiledGraphs:
    """The compiled graphs of one program, by key: ``"mixed"`` (dynamic token count: prefill and
    mixed steps) and ``("decode", R_b)`` (one static-shape graph per decode bucket). Each key
    gets its own GraphModule copy (its own code object, so dynamo caches never mix) wrapped in a
    :class:`FallbackGraph`. ``get`` returns None where the graph runs eagerly. Every compile is
    recorded in ``log`` (:class:`~.compile_log.CompileLog`). ``device_graphs`` (a capture maker,
    :func:`.device_graphs.device_graphs_for`): every key but ``"mixed"`` is also captured as a
    device graph (:class:`~.device_graphs.DeviceGraph`); None (the CPU) wraps nothing."""

    def __init__(self, program, name: str, factory, *, runs_compiled: bool, note: str | None = None,
                 eager_reason: str | None = None, device_graphs=None):
        self.program = program
        self.name = name
        self.factory = factory
        self.eager_reason = eager_reason  # the backend refused the whole program, and why
        self.runs_compiled = runs_compiled and factory is not None and eager_reason is None
        self.note = note
        self.device_graphs = device_graphs if self.runs_compiled else None
        self.log = CompileLog()
        self._graphs: dict[Any, Any] = {}

    def get(self, key) -> Callable | None:
        if not self.runs_compiled:
            return None
        if key not in self._graphs:
            from .fallback import FallbackGraph

            gm = self.program.graph_module
            copy = torch.fx.GraphModule(gm, gm.graph)
            factory, name = self.factory, _key_name(key)
            if getattr(factory, "wants_static", False):
                factory = functools.partial(factory, static=key != "mixed")
            on_compile = functools.partial(self.log.record, name)
            if getattr(self.factory, "counts_compiles", False):
                factory = functools.partial(factory, on_compile=on_compile)
                on_compile = None  # the factory reports each compile itself
            graph = FallbackGraph(name, copy, factory, backend=self.name, on_compile=on_compile)
            if self.device_graphs is not None and key != "mixed":
                from .device_graphs import DeviceGraph, static_inputs

                graph = DeviceGraph(name, graph, static_inputs(self.program), self.device_graphs)
            self._graphs[key] = graph
        return self._graphs[key]

    def report(self) -> dict:
        graphs = {_key_name(k): dict(g.status) for k, g in self._graphs.items()}
        for status in graphs.values():
            status.pop("traceback", None)
        out = {"backend": self.name, "graphs": graphs, "compile": self.log.report()}
        if self.note:
            out["note"] = self.note
        if self.eager_reason:
            out["eager_reason"] = self.eager_reason
        if self.device_graphs is not None:
            out["device_graphs"] = getattr(self.device_graphs, "kind", type(self.device_graphs).__name__)
        return out


def _key_name(key) -> str:
    return key if isinstance(key, str) else f"{key[0]}[{key[1]}]"


def compile_backend(program, backend: Any, *, distributed: bool, device_graphs=None) -> CompiledGraphs:
    """The graphs of ``program`` for ``backend``, compiled lazily per shape key; ``device_graphs``:
    the capture maker for static-shape keys (:func:`.device_graphs.device_graphs_for`), None for none."""
    name, factory = resolve_backend(backend)
    runs_compiled = distributed or program.mesh.world_size == 1
    note = None
    if factory is not None and not runs_compiled:
        note = f"{name} requested; the multi-rank emulator interprets the graph eagerly"
    eager_reason = None
    if factory is GE_FACTORY:
        from .npu.decide import ge_decision

        why = ge_decision(program.graph_module)
        if why is not None:
            eager_reason = f"{name} (GE) not used, the program runs eagerly: {why}"
            log.info("dcpgraph: %s", eager_reason)
    return CompiledGraphs(program, name, factory, runs_compiled=runs_compiled, note=note, eager_reason=eager_reason,
                          device_graphs=device_graphs)


def backend_provenance(program, graphs: CompiledGraphs):
    """``program`` with a ``backend`` provenance record when its backend refused it whole (so
    :func:`dcpgraph.explain` shows why it runs eagerly); ``program`` itself otherwise."""
    if graphs.eager_reason is None:
        return program
    return program.replace(provenance=(*program.provenance, Provenance("backend", 0.0, graphs.eager_reason)))


def use_compile_cache_dir(path: str) -> None:
    """Keep inductor's compiled graphs (its FX graph cache, generated code and built kernels) in
    ``path`` from now on, for this whole process (inductor reads ``TORCHINDUCTOR_CACHE_DIR``); a
    later process given the same path loads them instead of compiling."""
    import os

    os.makedirs(path, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.abspath(path)
    import torch._inductor.config as inductor_config

    inductor_config.fx_graph_cache = True
