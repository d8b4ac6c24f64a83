"""torchair (Ascend) backends: GE graph mode ("max-autotune") and aclgraph capture ("npugraph_ex").

:func:`compile_torchair` is what the registry's ``"torchair"`` and ``"npugraph_ex"`` factories
call. Everything Ascend-specific is imported lazily, inside the call:

- with the real stack (torch-npu + CANN): ``import torch_npu`` first — it installs torchair as
  ``sys.modules["torchair"]`` — then ``import torchair``;
- if ``torchair`` is importable without torch_npu (the CPU test tier extracts it from the wheel and
  supplies Python stand-ins for its C extensions) that one is used;
- if neither imports, :class:`ImportError` says why (on CPU: torch_npu is not installed, or it is
  and fails to load CANN's libraries). :class:`~dcpgraph.backends.fallback.FallbackGraph` turns
  that into eager execution with the reason recorded.

Modes:

``"max-autotune"`` (GE)
    Every FX node needs a GE converter and dcpgraph's ops have none, so the graph is first
    rewritten by :func:`dcpgraph.backends.npu.lower_npu` (attention → FusedInferAttentionScore,
    merge → AttentionUpdate or aten, KV writes → ``scatter_``; collectives stay functional and
    become Hcom ops). Conversion to GE happens while torch.compile compiles, which for a
    ``torch.compile`` callable is at its first call; GE compile and run happen right after, in
    that same first call. On a machine without CANN that first call therefore fails after
    conversion (and after the graph dump, when ``dump_dir`` is set).
    A graph holding a dcpgraph op with no lowering rule (DeepSeek-V4's compressed ops) is
    refused before torchair is imported, naming the ops; :func:`dcpgraph.compile` decides such a
    program eager before compiling anything (:func:`dcpgraph.backends.compile_backend`).
``"npugraph_ex"`` (aclgraph)
    Ops run as eager aclnn/ATen kernels captured into an NPU graph; only fake (meta) kernels are
    needed, which every dcpgraph op has, so the graph is not lowered. With torch_npu present the
    dynamo backend ``"npugraph_ex"`` (registered by the wheel's entry points) is used with
    ``options`` (``frozen_parameter``); with a bare torchair, its ``CompilerConfig.mode =
    "npugraph_ex"``. Note that dcpgraph's reference kernels are CPU kernels: on an NPU they run as
    host ops with device↔host copies until dcpgraph registers NPU (PrivateUse1) kernels for them.

Options exposed: ``frozen_parameter`` (``experimental_config.frozen_parameter``: parameters and
``mark_static_address`` tensors as fixed device addresses; note that a dcpgraph program takes its
weights and KV caches as graph *inputs*, so this only covers inputs the caller marked with
``torch._dynamo.mark_static_address``), ``dynamic`` (torch.compile's; ``False`` gives one static GE
graph per distinct set of input shapes — token count, request count, block-table width, cache
blocks — while ``True`` gives one dynamic-shape graph with host scheduling), ``dump_dir`` (GE graph
dumped there as ``.pbtxt``: ``debug.graph_dump.type = "pbtxt"``), ``merge`` (see
:func:`~dcpgraph.backends.npu.lower_npu`), and ``config``: a ready
``torchair.CompilerConfig`` that replaces mode/frozen_parameter/dump_dir.

What is verified without Ascend hardware (``tests/torchair_tier``, torchair's Python code from the
torch-npu 2.13.0 wheel with stand-ins for its C extensions, two gloo ranks): conversion of
dcpgraph's DCP decode programs (GQA and MLA, a2a and ag_rs, static shapes) to GE succeeds, which GE
ops come out, and that the lowered graph, run on CPU with reference kernels of the two Ascend ops
written from their documentation, reproduces eager's logits and KV caches. ``dynamic=True``
conversion was checked by hand once (it converts), not by the tier. Not verified: GE/CANN compile,
the Ascend kernels' numerics and limits, performance, and the npugraph_ex path (torchair's aclgraph
compiler needs torch_npu's own ops even to build; capture needs an NPU).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from typing import Any

import torch

MODES = ("max-autotune", "npugraph_ex")


def import_torchair():
    """The ``torchair`` module: via torch_npu on Ascend, or an already importable one."""
    errors: list[str] = []
    if "torchair" in sys.modules and sys.modules["torchair"] is not None:
        return importlib.import_module("torchair")
    if importlib.util.find_spec("torch_npu") is not None:
        try:
            import torch_npu  # noqa: F401 - installs torchair and the npu:: ops
        except Exception as err:  # noqa: BLE001 - without CANN this fails in many ways
            errors.append(f"import torch_npu failed: {type(err).__name__}: {err}")
    else:
        errors.append("torch_npu is not installed")
    try:
        return importlib.import_module("torchair")
    except Exception as err:  # noqa: BLE001
        errors.append(f"import torchair failed: {type(err).__name__}: {err}")
    raise ImportError(
        "the torchair backend needs torch-npu (which ships torchair) on an Ascend machine with "
        "CANN: " + "; ".join(errors)
    )


def make_config(torchair, *, mode: str = "max-autotune", frozen_parameter: bool = False,
                dump_dir: str | os.PathLike | None = None):
    """A ``torchair.CompilerConfig`` with dcpgraph's choices set."""
    config = torchair.CompilerConfig()
    config.mode = mode
    config.experimental_config.frozen_parameter = bool(frozen_parameter)
    if dump_dir is not None:
        os.makedirs(dump_dir, exist_ok=True)
        config.debug.graph_dump.type = "pbtxt"
        config.debug.graph_dump.path = str(dump_dir)
    return config


def compile_torchair(
    gm: torch.fx.GraphModule,
    example_inputs: list,
    *,
    mode: str = "max-autotune",
    frozen_parameter: bool = False,
    dynamic: bool = False,
    config: Any = None,
    dump_dir: str | os.PathLike | None = None,
    merge: str = "auto",
) -> Callable:
    """``torch.compile`` of ``gm`` through torchair (see the module docstring).

    ``merge`` is :func:`~dcpgraph.backends.npu.lower_npu`'s choice for ``merge_attention``
    (``"auto"``: ``npu_attention_update`` where its limits allow). The returned callable compiles
    at its first call; ``gm`` itself is never modified.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode == "max-autotune":  # refuse a graph GE cannot take before importing anything
        from .npu import NpuLoweringError
        from .npu.decide import ge_decision

        why = ge_decision(gm)
        if why is not None:
            raise NpuLoweringError(why)
    torchair = import_torchair()
    if mode == "npugraph_ex":
        if "torch_npu" in sys.modules and config is None:
            options = {"frozen_parameter": bool(frozen_parameter)}
            compiled = torch.compile(gm.forward, backend="npugraph_ex", options=options, dynamic=dynamic,
                                     fullgraph=True)
            return TorchairGraph(compiled, None, mode, None)
        config = config or make_config(torchair, mode=mode, frozen_parameter=frozen_parameter, dump_dir=dump_dir)
        backend = torchair.get_npu_backend(compiler_config=config)
        return TorchairGraph(torch.compile(gm.forward, backend=backend, dynamic=dynamic, fullgraph=True),
                             None, mode, config)
    from .npu import lower_npu

    lowered = lower_npu(gm, example_inputs, merge=merge)
    config = config or make_config(torchair, mode=mode, frozen_parameter=frozen_parameter, dump_dir=dump_dir)
    backend = torchair.get_npu_backend(compiler_config=config)
    return TorchairGraph(torch.compile(lowered.forward, backend=backend, dynamic=dynamic, fullgraph=True),
                         lowered, mode, config)


class TorchairGraph:
    """The compiled callable, with what it was built from (``lowered``: the GraphModule GE got).

    ``torch.compile`` is applied to ``lowered.forward``, not to the module: with the module,
    an error raised by GE's lazy compile/run at the first call is re-raised by GraphModule's
    error reporting under dynamo's frame callback, which then fails with an unrelated
    "Attempt to trace generator" (fullgraph=True) and hides the real error.
    """

    def __init__(self, compiled: Callable, lowered: torch.fx.GraphModule | None, mode: str, config: Any):
        self.compiled = compiled
        self.lowered = lowered
        self.mode = mode
        self.config = config

    def __call__(self, *args):
        return self.compiled(*args)
