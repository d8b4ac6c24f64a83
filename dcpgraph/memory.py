"""KV-cache sizing from a fraction of memory, as vLLM's ``--gpu-memory-utilization``.

On a rank, with ``F`` the fraction, ``M`` the memory of its device (``cuda``, ``npu``: the
device's total; ``cpu``: the host memory this process may still take, :func:`host_memory_bytes`)
and ``S`` the ranks that share that memory (one per accelerator under a distributed world; every
rank of the process with the emulated executor; on the host, the ranks on it)::

    kv_bytes   = F · M / S − weights − peak − state
    num_blocks = kv_bytes // bytes_per_block

``weights`` are this rank's parameter shards (:func:`dcpgraph.program.weight_bytes_per_rank`),
``peak`` the activation peak of a dummy forward of ``max_num_batched_tokens`` tokens
(:func:`activation_peak_bytes`), ``state`` a hybrid's recurrent-state pools on this rank
(``max_num_seqs`` slots, twice that with speculative decoding: a snapshot row per slot,
:mod:`dcpgraph.runtime.state_rollback`; :func:`recurrent_state_bytes`; 0 without recurrent layers) and ``bytes_per_block`` one block of every cache
(:func:`dcpgraph.kv_budget.kv_bytes_per_block`; a hybrid cache splits ``kv_bytes`` with its
sliding pool, :func:`dcpgraph.kv_budget.split_byte_budget`).

Defaults. On an accelerator, without a cache size, ``F = 0.9`` (vLLM's). On the host, without the
flag, the cache keeps dcpgraph's default (every sequence slot at ``max_model_len``): the host's
memory is shared with everything else the machine runs, and vLLM's CPU build likewise does not
size from a fraction but takes an explicit KV space (``VLLM_CPU_KVCACHE_SPACE``, 4 GiB by default).

The memory query is :func:`device_memory`, one function of the device, so a test can fake a CUDA
or NPU device's memory.
"""

from __future__ import annotations

import gc
import math
import operator
import os
from dataclasses import asdict, dataclass

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode

from .errors import ConfigError
from .kv_budget import blocks_for_budget, kv_bytes_per_block
from .program import Program, example_specs, weight_bytes_per_rank

DEVICE_DEFAULT_UTILIZATION = 0.9  # vLLM's default on accelerators
MEMINFO = "/proc/meminfo"
CGROUP_V2 = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current")
CGROUP_V1 = ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes")


@dataclass(frozen=True)
class DeviceMemory:
    """A device's memory in bytes: ``total`` (what the fraction is of) and ``free`` (what can be
    allocated now: a bound the KV cache and the activation peak must fit in)."""

    total: int
    free: int


# -- how much memory there is ---------------------------------------------------------------------
def _read_int(path: str) -> int | None:
    try:
        with open(path, encoding="ascii") as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # cgroup v2 writes "max" for no limit


def meminfo_available() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes (None where there is no such file)."""
    try:
        with open(MEMINFO, encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def cgroup_room() -> int | None:
    """Bytes this process's memory cgroup still allows (limit − usage), None without a limit."""
    for limit_path, usage_path in (CGROUP_V2, CGROUP_V1):
        limit, usage = _read_int(limit_path), _read_int(usage_path)
        if limit is not None and usage is not None and limit < 1 << 60:  # v1 writes ~2^63 for none
            return max(0, limit - usage)
    return None


def host_memory_bytes() -> int:
    """Host memory this process may still take: the smaller of ``MemAvailable`` and its cgroup's
    room; the machine's physical memory where neither can be read."""
    figures = [x for x in (meminfo_available(), cgroup_room()) if x is not None]
    if figures:
        return min(figures)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def device_type(device: torch.device | str) -> str:
    """``"cpu"``, ``"cuda"``, ``"npu"``... of a device or its name (``"npu:0"`` is a name torch
    parses only once ``torch_npu`` is imported)."""
    return device.type if isinstance(device, torch.device) else str(device).split(":")[0]


def _accelerator(device: torch.device | str):
    """``torch.cuda`` or ``torch.npu`` (``torch_npu``'s, present once it is imported)."""
    kind = device_type(device)
    module = getattr(torch, kind, None)
    if module is None or not hasattr(module, "mem_get_info"):
        raise ConfigError(f"cannot query the memory of device {device}: torch.{kind} is not available")
    return module


def device_memory(device: torch.device | str) -> DeviceMemory:
    """The memory of ``device``: the host's for ``cpu`` (:func:`host_memory_bytes`, total = free);
    for ``cuda``/``npu`` the device's total, and as free what the driver reports free plus what this
    process's caching allocator holds unused (``memory_reserved − memory_allocated``)."""
    if device_type(device) == "cpu":
        available = host_memory_bytes()
        return DeviceMemory(available, available)
    module = _accelerator(device)
    gc.collect()  # engines no longer referenced give their caches back to the allocator
    free, total = module.mem_get_info(device)
    cached = module.memory_reserved(device) - module.memory_allocated(device)
    return DeviceMemory(int(total), int(free + cached))


# -- the activation peak --------------------------------------------------------------------------
def _tensor_bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def _aliased_input(node: torch.fx.Node) -> torch.fx.Node | None:
    """The input a node's result is a view of (``getitem`` of a tuple, a view op by its schema)."""
    inputs = [a for a in node.args if isinstance(a, torch.fx.Node)]
    if not inputs:
        return None
    if node.target is operator.getitem:
        return inputs[0]
    schema = getattr(node.target, "_schema", None)
    if schema is not None and schema.returns and all(r.alias_info is not None for r in schema.returns):
        return inputs[0]
    return None


def _lifetimes(graph: torch.fx.Graph) -> tuple[dict, dict]:
    """``owner``: each node -> the node whose allocation its result lives in (itself, or the base
    of the view it is); ``dies_at``: node -> the owners whose last use it is (an owner nothing uses
    dies at itself; the graph's outputs never die)."""
    owner: dict[torch.fx.Node, torch.fx.Node] = {}
    last_use: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in graph.nodes:
        base = _aliased_input(node)
        owner[node] = owner[base] if base is not None else node
        last_use.setdefault(owner[node], node)
        for arg in node.all_input_nodes:
            last_use[owner[arg]] = node
    dies_at: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for allocation, last in last_use.items():
        if last.op != "output":
            dies_at.setdefault(last, []).append(allocation)
    return owner, dies_at


class _PeakInterpreter(torch.fx.Interpreter):
    """Runs a graph on fake tensors, adding up the bytes of the live intermediate values: each
    node's result is live from the node until its last user has run (a view keeps its base alive
    and costs nothing itself). Placeholders (weights, caches, step inputs) are not counted."""

    def __init__(self, gm: torch.fx.GraphModule):
        super().__init__(gm)
        self.owner, self.dies_at = _lifetimes(gm.graph)
        self.sizes: dict[torch.fx.Node, int] = {}
        self.live = self.peak = 0

    def run_node(self, n: torch.fx.Node):
        result = super().run_node(n)
        if n.op not in ("placeholder", "output") and self.owner[n] is n:
            self.sizes[n] = _tensor_bytes(result)
            self.live += self.sizes[n]
        self.peak = max(self.peak, self.live)
        for allocation in self.dies_at.get(n, ()):
            self.live -= self.sizes.pop(allocation, 0)
        return result


def activation_peak_bytes(program: Program, *, tokens: int, requests: int) -> int:
    """Peak bytes of intermediate tensors on one rank in a forward of ``tokens`` tokens over
    ``requests`` requests (vLLM's profile run is one of ``max_num_batched_tokens``).

    Estimated, not measured: the rank's graph runs on fake tensors and every node's result counts
    from the node to its last use (:class:`_PeakInterpreter`). It is taken on every device because
    the cache size is decided in :func:`dcpgraph.compile` before any executor holds weights or caches
    (the serving ranks read their weights afterwards), so no forward can run yet; on the host an RSS
    reading would also mix in the allocator's and other threads' noise. What it leaves out:
    scratch space inside one op (an attention kernel's workspace) and allocator fragmentation, both
    small next to the ``max_num_batched_tokens × vocabulary`` and MLP intermediates it sees."""
    width = math.ceil(tokens / max(1, requests) / int(program.lowering.block_size or 16)) + 1
    interpreter = _PeakInterpreter(program.graph_module)
    with FakeTensorMode(allow_non_fake_inputs=True):
        args = [torch.empty(shape, dtype=dtype)
                for shape, dtype in example_specs(program, tokens=tokens, requests=requests, table_width=width)]
        interpreter.run(*args)
    return int(interpreter.peak)


# -- the sizing -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class MemorySizing:
    """How one rank's KV cache was sized from a memory fraction (every figure in bytes, per rank):
    ``kv_bytes = utilization · device_memory / ranks_sharing − weight_bytes − activation_peak_bytes
    − recurrent_state_bytes``, ``num_blocks = kv_bytes // bytes_per_block`` (the full group's blocks
    for a hybrid cache)."""

    utilization: float
    device: str
    device_memory: int
    ranks_sharing: int
    weight_bytes: int
    activation_peak_bytes: int
    kv_bytes: int
    bytes_per_block: int
    num_blocks: int
    recurrent_state_bytes: int = 0

    def report(self) -> dict:
        return {"policy": "gpu_memory_utilization", **asdict(self)}

    def describe(self) -> str:
        return (f"KV cache {self.num_blocks} blocks per rank = ({self.utilization} x {size_text(self.device_memory)} "
                f"{self.device} / {self.ranks_sharing} ranks - {size_text(self.weight_bytes)} weights - "
                f"{size_text(self.activation_peak_bytes)} activation peak"
                + (f" - {size_text(self.recurrent_state_bytes)} recurrent state" if self.recurrent_state_bytes else "")
                + f") / {self.bytes_per_block} B per block")


def size_text(nbytes: float) -> str:
    """``nbytes`` in the largest binary unit that keeps it >= 1 (``"3.21 GiB"``)."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{int(nbytes)} B"


def ranks_sharing(device: torch.device | str, tp: int, *, distributed: bool, ranks_on_host: int | None = None) -> int:
    """Ranks whose KV caches share ``device``'s memory. An accelerator: one rank each under a
    distributed world (``cuda:{local_rank}``), every rank of the mesh with the emulated executor.
    The host: ``ranks_on_host`` when the deployment says (``dcpgraph serve``: its ranks on this
    node, data-parallel replicas included), else torchrun's ``LOCAL_WORLD_SIZE``, else the mesh's
    ``tp`` ranks (one host)."""
    if device_type(device) != "cpu":
        return 1 if distributed else tp
    if ranks_on_host is not None:
        return int(ranks_on_host)
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(local) if local.isdigit() and int(local) > 0 else tp


def default_utilization(device: torch.device | str, given: float | None) -> float | None:
    """The fraction that applies: the one given; else 0.9 on an accelerator and None (dcpgraph's
    default sizing) on the host."""
    if given is not None:
        return float(given)
    return None if device_type(device) == "cpu" else DEVICE_DEFAULT_UTILIZATION


def size_for_utilization(program: Program, utilization: float, device: torch.device | str, *, ranks: int,
                         max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
                         decode_tokens: int = 1) -> MemorySizing:
    """:class:`MemorySizing` of ``program``'s rank 0 on ``device`` (module docstring's formula).
    A budget that buys no block, or a KV cache and activation peak that do not fit in the memory
    free now, is a :class:`ConfigError` with the figures."""
    on_host = device_type(device) == "cpu"
    memory = device_memory(device)
    weights = max(weight_bytes_per_rank(program))
    tokens = min(max_num_batched_tokens, max_model_len)
    peak = activation_peak_bytes(program, tokens=tokens, requests=min(max_num_seqs, tokens))
    state = recurrent_state_bytes(program, max_num_seqs + int(program.lowering.state_snapshots or 0)
                                  + int(program.lowering.state_prefix_rows or 0))
    kv_bytes = int(utilization * memory.total / ranks) - weights - peak - state
    per_block = kv_bytes_per_block(program)
    if kv_bytes < per_block:
        raise ConfigError(
            f"gpu_memory_utilization={utilization}: {utilization} x {size_text(memory.total)} of {device} / "
            f"{ranks} ranks leaves {size_text(kv_bytes)} for the KV cache after {size_text(weights)} of weights, "
            f"a {size_text(peak)} activation peak and {size_text(state)} of recurrent state, less than one "
            f"{per_block}-byte block; raise it, lower max_num_batched_tokens, or give the cache size "
            "(num_gpu_blocks_override / kv_cache_memory_bytes)")
    needed = (kv_bytes + peak + state) * ranks
    if not on_host and needed > memory.free:
        raise ConfigError(
            f"gpu_memory_utilization={utilization} asks for {size_text(needed)} of KV cache and activations on "
            f"{device}, but only {size_text(memory.free)} are free (other processes hold the rest); lower it")
    blocks = blocks_for_budget(program, kv_cache_bytes_per_rank=kv_bytes, max_model_len=max_model_len,
                               max_num_seqs=max_num_seqs, decode_tokens=decode_tokens, step_tokens=tokens)
    return MemorySizing(utilization, str(device), memory.total, ranks, weights, peak, kv_bytes, per_block, blocks,
                        state)


def recurrent_state_bytes(program: Program, slots: int) -> int:
    """Bytes of ``program``'s recurrent-state pools on one rank with ``slots`` slots:
    ``slots · Σ_pools Π(shape per slot) · element_bytes`` (0 without recurrent layers)."""
    return slots * sum(math.prod(p.shape) * p.dtype.itemsize for p in program.recurrent_states)


def agreed_blocks(num_blocks: int, device: torch.device | str) -> int:
    """The smallest of every rank's ``num_blocks`` in an initialised ``torch.distributed`` world
    (each rank read its own memory, at its own moment; the block table they share must fit every
    rank, as vLLM takes the minimum over its workers); ``num_blocks`` itself outside one."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return num_blocks
    on = device if str(dist.get_backend()).lower() in ("nccl", "hccl") else torch.device("cpu")
    value = torch.tensor([num_blocks], dtype=torch.int64, device=on)
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return int(value.item())
