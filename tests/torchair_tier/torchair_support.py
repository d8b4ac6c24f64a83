"""Make torchair's FX→GE lowering importable on a CPU-only machine, for the ``torchair`` test tier.

torchair ships inside the torch-npu wheel (``torch_npu/dynamo/torchair``). Installing torch-npu
breaks ``import torch`` without Ascend CANN, so the wheel is never installed: it is downloaded
once (``pip download --no-deps torch-npu==2.13.0``) into the gitignored ``.torchair_cache/`` of
the repository, and only ``torch_npu/dynamo/torchair/*`` (minus its four C extensions) is
extracted, next to the two schema lines this tier needs from the wheel's op yaml. torchair needs
``protobuf`` (it builds GE ``GraphDef`` protos); when it is not installed it is added to
``.torchair_cache/pydeps`` with ``pip install --target`` (nothing in the system site changes).

Split in two halves on purpose:

* :func:`prepare` runs in the pytest process. It only downloads and unpacks, and returns a
  :class:`TorchairTier` (paths, or the reason the tier must be skipped). It imports nothing
  from torchair.
* :func:`activate` runs in the worker processes (``dcpgraph.runtime.distributed.spawn``). It puts
  the extracted directory on ``sys.path``, installs the Python stand-ins for torchair's C
  extensions, declares the two ``npu::`` ops, and imports torchair. Doing this only in the workers
  keeps torchair's process-wide side effects (SIGINT/SIGTERM handlers, an ``atexit`` finalizer,
  fake modules in ``sys.modules``, ``npu::`` op registrations) out of the pytest process, where
  other tests expect ``torchair`` to be absent.

The stand-ins (never used by the library) — only what conversion needs:

``torchair.core._torchair``
    ``TorchNpuGraphBase`` (the GE graph handle): ``load``/``set_hint_shape`` record what they
    get (so a test can read the serialized GE graph), ``compile``/``run``/``auto_tune`` raise
    :class:`GeUnavailableError` — GE compile and run happen at the first call, which therefore
    fails, as it would on any machine without CANN. ``get_registered_ir_def`` reports every GE IR
    as unregistered (so auto-generated converters for unknown ops fail loudly, as they should);
    ``check_cann_compat`` reports every op as compatible; ``InitializeGraphEngine`` (called while
    the GE graph is built) records its options; ``FinalizeGraphEngine`` (torchair's ``atexit``
    hook) and ``SetDebugLogPath`` do nothing. ``TorchDataType`` is a plain enum (the dtype table
    of ``torchair.llm_datadist`` reads it at import). Anything else raises ``AttributeError``
    naming the missing attribute.
``torchair.core._npu_graph_executor``, ``._abi_compat_ge_apis``, ``._npu_utils``
    empty modules (imported lazily by code paths that need a real NPU).

``npu::npu_fused_infer_attention_score`` and ``npu::npu_attention_update`` are registered by
``libtorch_npu.so`` on a real NPU. Here they are declared with ``torch.library`` from the schema
lines of the wheel's ``npu_native_functions_by_codegen.yaml`` (so they match the real ones
exactly), with fake kernels written here (shapes per the op documentation), so torchair's own
converter modules for them load. (dcpgraph's lowering emits torchair's tensor-length FIAS overload,
``air::npu_fused_infer_attention_score``, which torchair itself defines with a meta kernel, and
torch_npu's ``npu_attention_update``.)

Also here, for the tests: :func:`register_cpu_references` (CPU kernels of the two Ascend ops as
documented, to run a lowered graph on CPU; opt-in, worker side) and :func:`read_ge_dump` (the
nodes of torchair's ``.pbtxt`` GE graph dump).

Cost: the first run downloads 44 MB and unpacks ~11 MB (a few seconds with PyPI reachable);
later runs reuse ``.torchair_cache/``. ``import torchair`` with the stand-ins takes ~4–10 s.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import types
import warnings
import zipfile
from pathlib import Path

TORCH_NPU_VERSION = "2.13.0"
REPO_ROOT = Path(__file__).resolve().parents[2]
CACHE_DIR = REPO_ROOT / ".torchair_cache"
EXTRACT_DIR = CACHE_DIR / f"torch_npu-{TORCH_NPU_VERSION}"
PYDEPS_DIR = CACHE_DIR / "pydeps"
SCHEMA_FILE = EXTRACT_DIR / "npu_schemas.txt"
NPU_OPS = ("npu_fused_infer_attention_score", "npu_attention_update", "npu_kv_rmsnorm_rope_cache")
_YAML = "torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml"
_PREFIX = "torch_npu/dynamo/torchair/"


class GeUnavailableError(RuntimeError):
    """Raised by the stand-ins wherever the real code would call into CANN's graph engine."""


@dataclasses.dataclass(frozen=True)
class TorchairTier:
    dynamo_dir: str | None  # the directory that holds the extracted ``torchair`` package
    pydeps_dir: str | None  # extra site dir (protobuf) or None when the system has it
    skip_reason: str | None = None


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_ROOT_USER_ACTION": "ignore"}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)


def _wheel() -> Path:
    found = sorted(CACHE_DIR.glob(f"torch_npu-{TORCH_NPU_VERSION}-*.whl"))
    if found:
        return found[0]
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    done = _run([sys.executable, "-m", "pip", "download", "--no-deps", f"torch-npu=={TORCH_NPU_VERSION}",
                 "-d", str(CACHE_DIR)])
    found = sorted(CACHE_DIR.glob(f"torch_npu-{TORCH_NPU_VERSION}-*.whl"))
    if done.returncode or not found:
        lines = (done.stderr or done.stdout).strip().splitlines()
        raise RuntimeError(lines[-1][:300] if lines else f"pip exited with {done.returncode}")
    return found[0]


def _schema_lines(z: zipfile.ZipFile) -> list[str]:
    schemas = []
    for line in z.read(_YAML).decode().splitlines():
        m = re.match(r"\s*-\s*func:\s*((\w+)\(.*)$", line)
        if m and m.group(2) in NPU_OPS and m.group(1) not in schemas:
            schemas.append(m.group(1))
    return schemas


def _refresh_schemas(wheel: Path) -> None:
    """Rewrite ``npu_schemas.txt`` when an earlier extraction predates an op of :data:`NPU_OPS`."""
    have = {s.split("(", 1)[0] for s in SCHEMA_FILE.read_text().split("\n") if s}
    if set(NPU_OPS) <= have:
        return
    with zipfile.ZipFile(wheel) as z:
        text = "\n".join(_schema_lines(z)) + "\n"
    tmp = SCHEMA_FILE.with_name(f"{SCHEMA_FILE.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    tmp.replace(SCHEMA_FILE)


def _extract(wheel: Path) -> None:
    """Unpack ``torch_npu/dynamo/torchair`` (no ``.so``) and the schema lines of
    :data:`NPU_OPS`, atomically."""
    if (EXTRACT_DIR / ".complete").exists():
        _refresh_schemas(wheel)
        return
    tmp = EXTRACT_DIR.with_name(f"{EXTRACT_DIR.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    with zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist() if n.startswith(_PREFIX) and not n.endswith(".so")]
        z.extractall(tmp, names)
        schemas = _schema_lines(z)
    (tmp / "npu_schemas.txt").write_text("\n".join(schemas) + "\n")
    (tmp / ".complete").write_text(wheel.name + "\n")
    if EXTRACT_DIR.exists() and not (EXTRACT_DIR / ".complete").exists():
        shutil.rmtree(EXTRACT_DIR, ignore_errors=True)  # a half-done earlier extraction
    try:
        tmp.rename(EXTRACT_DIR)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
        if not (EXTRACT_DIR / ".complete").exists():
            raise


def _protobuf_dir() -> str | None:
    try:
        if importlib.util.find_spec("google.protobuf") is not None:
            return None
    except ModuleNotFoundError:  # no "google" namespace at all
        pass
    if not (PYDEPS_DIR / "google" / "protobuf").is_dir():
        done = _run([sys.executable, "-m", "pip", "install", "-q", "--target", str(PYDEPS_DIR),
                     "protobuf>=3.13"])
        if done.returncode:
            lines = (done.stderr or done.stdout).strip().splitlines()
            raise RuntimeError(lines[-1][:300] if lines else f"pip exited with {done.returncode}")
    return str(PYDEPS_DIR)


def prepare() -> TorchairTier:
    """Download/extract once (cached); never imports torchair. Safe to call repeatedly."""
    try:
        _extract(_wheel())
    except Exception as err:  # noqa: BLE001 - any failure here means the tier cannot run
        return TorchairTier(None, None, f"torch-npu {TORCH_NPU_VERSION} wheel unavailable: {err}; "
                                        "needs network access to PyPI")
    try:
        pydeps = _protobuf_dir()
    except Exception as err:  # noqa: BLE001
        return TorchairTier(None, None, f"protobuf (needed by torchair) unavailable: {err}; "
                                        "needs network access to PyPI")
    return TorchairTier(str(EXTRACT_DIR / "torch_npu" / "dynamo"), pydeps)


# -- worker side -----------------------------------------------------------------------------
class TorchDataType(enum.Enum):
    """Names only (values arbitrary): ``torchair.llm_datadist`` builds a dtype table from them."""

    FLOAT32 = enum.auto()
    FLOAT16 = enum.auto()
    BF16 = enum.auto()
    FLOAT64 = enum.auto()
    INT8 = enum.auto()
    INT16 = enum.auto()
    INT32 = enum.auto()
    INT64 = enum.auto()
    UINT8 = enum.auto()
    UINT16 = enum.auto()
    UINT32 = enum.auto()
    UINT64 = enum.auto()
    BOOL = enum.auto()
    COMPLEX64 = enum.auto()
    COMPLEX128 = enum.auto()


class TorchNpuGraphBase:
    """Stand-in for the GE graph handle: records what ``load`` gets; cannot compile or run."""

    loaded: list = []  # (name, serialized GraphDef bytes, options) of every load, in order

    def __init__(self, name: str = ""):
        self.name = name

    def load(self, serialized, options, *args):
        TorchNpuGraphBase.loaded.append((self.name, serialized, dict(options)))

    def set_hint_shape(self, *args):
        pass

    def compile(self):
        raise GeUnavailableError("GE compile needs Ascend CANN (Python stand-in for torchair.core._torchair)")

    def auto_tune(self, *args):
        raise GeUnavailableError("GE auto_tune needs Ascend CANN (Python stand-in)")

    def run(self, *args):
        raise GeUnavailableError("GE run needs Ascend CANN (Python stand-in)")


def _initialize_graph_engine(options):
    ENGINE_OPTIONS.update(options)  # torchair calls it while building the GE graph; nothing to do


ENGINE_OPTIONS: dict = {}


def _core_module() -> types.ModuleType:
    mod = types.ModuleType("torchair.core._torchair")
    mod.__doc__ = "Python stand-in for torchair's C extension (tests/torchair_tier only)."
    mod.TorchNpuGraphBase = TorchNpuGraphBase
    mod.TorchDataType = TorchDataType
    mod.get_registered_ir_def = lambda name: ("ERROR", None, None, None)
    mod.check_cann_compat = lambda optype, inputs, attrs: ""
    mod.InitializeGraphEngine = _initialize_graph_engine
    mod.FinalizeGraphEngine = lambda: None
    mod.SetDebugLogPath = lambda path: None

    def __getattr__(name):
        raise AttributeError(f"the torchair test stand-in has no {name!r}: add it to "
                             "tests/torchair_tier/torchair_support.py if conversion needs it")

    mod.__getattr__ = __getattr__
    return mod


def _declare_npu_ops(schema_file: Path) -> None:
    import torch

    if hasattr(torch.ops, "npu") and all(hasattr(torch.ops.npu, op) for op in NPU_OPS):
        return  # a real torch_npu (or an earlier call) already has them
    schemas = {s.split("(", 1)[0]: s for s in schema_file.read_text().split("\n") if s}
    missing = [op for op in NPU_OPS if op not in schemas]
    if missing:
        raise RuntimeError(f"schemas of {missing} not found in the wheel's {_YAML}")
    lib = torch.library.Library("npu", "FRAGMENT")  # noqa: TOR901 - stands in for libtorch_npu
    _LIBS.append(lib)
    for op in NPU_OPS:
        lib.define(schemas[op])

    def fias_fake(query, key, value, *, input_layout="BSH", num_heads=1, softmax_lse_flag=False,
                  block_table=None, num_key_value_heads=0, **_):
        # Only the layouts dcpgraph emits (TND, BSND); out has the query's shape with the value's
        # head dim, lse is [T, N, 1] (TND) or [B, N, S, 1] (BSND), fp32.
        kv_heads = num_key_value_heads or num_heads
        if block_table is not None and value.dim() == 3:
            dv = value.shape[-1] // kv_heads
        else:
            dv = value.shape[-1]
        out = query.new_empty((*query.shape[:-1], dv))
        if not softmax_lse_flag:
            return out, query.new_empty((0,), dtype=torch.float32)
        if input_layout == "TND":
            lse_shape = (query.shape[0], query.shape[1], 1)
        elif input_layout == "BSND":
            lse_shape = (query.shape[0], query.shape[2], query.shape[1], 1)
        else:
            raise NotImplementedError(f"test fake of FIAS: layout {input_layout} not modelled")
        return out, query.new_empty(lse_shape, dtype=torch.float32)

    def update_fake(lse, local_out, update_type):
        return torch.empty_like(local_out[0]), torch.empty_like(lse[0])

    def kv_rmsnorm_rope_cache_fake(kv, gamma, cos, sin, index, k_cache, ckv_cache, *, v=None, **_):
        # the caches as updated, then k_pe [B, 1, S, rope] and c_kv [B, 1, S, rms] (torch_npu's meta)
        rows = tuple(kv.shape[:-1])
        return (torch.empty_like(k_cache), torch.empty_like(ckv_cache),
                kv.new_empty((*rows, cos.shape[-1])), kv.new_empty((*rows, gamma.shape[0])))

    torch.library.register_fake("npu::npu_fused_infer_attention_score", fias_fake, lib=lib)
    torch.library.register_fake("npu::npu_attention_update", update_fake, lib=lib)
    torch.library.register_fake("npu::npu_kv_rmsnorm_rope_cache", kv_rmsnorm_rope_cache_fake, lib=lib)


_LIBS: list = []


def activate(tier: TorchairTier):
    """In a worker: stand-ins, ``npu::`` ops, ``sys.path``; returns the imported ``torchair``."""
    if tier.skip_reason:
        raise RuntimeError(tier.skip_reason)
    # gloo stands in for HCCL here, and on Ascend the groups stay HCCL's: torchair's converters
    # read a c10d-registered group's ranks, which dcpgraph's shared-memory host groups are not.
    os.environ["DCPGRAPH_HOST_COLLECTIVES"] = "gloo"
    for path in (tier.pydeps_dir, tier.dynamo_dir):
        if path and path not in sys.path:
            sys.path.insert(0, path)
    if "torchair" not in sys.modules:
        # torchair imports every converter module under ge_converter/custom and warns for each
        # npu:: op this stand-in does not declare (about 60 of them): expected, not interesting.
        warnings.filterwarnings("ignore", message="Failed to import torchair", category=UserWarning)
        sys.modules["torchair.core._torchair"] = _core_module()
        for name in ("_npu_graph_executor", "_abi_compat_ge_apis", "_npu_utils"):
            sys.modules[f"torchair.core.{name}"] = types.ModuleType(f"torchair.core.{name}")
        _declare_npu_ops(Path(tier.dynamo_dir).parents[1] / "npu_schemas.txt")
    import torchair

    return torchair


# -- CPU reference kernels (worker side, opt-in) --------------------------------------------------
def register_cpu_references() -> None:
    """CPU kernels for the two Ascend ops the lowering emits, so a lowered graph can run on CPU.

    They implement the ops as their documentation describes them, for the layouts dcpgraph emits
    (TND; paged KV ``[NB, B, Hkv·D]`` with a per-request ``actual_seq_lengths_kv``, or contiguous
    KV with cumulative ``actual_seq_lengths_kv``; ``sparse_mode`` 0 or 3; optional
    ``query_rope``/``key_rope``). Rows whose request has no key get a deliberately bad result
    (out NaN, lse 0), since what FIAS returns there is not documented: the lowering must mask them.
    ``npu_attention_update`` has no edge-rule handling of its own (its lse output is NaN unless
    ``update_type == 1``). Running a lowered graph with these therefore checks dcpgraph's side of
    the lowering (KV writes, masking, merge edge rules, reshapes, length conventions as read from
    the docs) — not the Ascend kernels. torchair registers a raising CPU kernel for the ``air`` op;
    this overrides it in the calling process only.
    """
    import torch
    import torchair.ops._npu_fused_infer_attention_score  # noqa: F401 - defines air::...

    lib = torch.library.Library("air", "FRAGMENT")  # noqa: TOR901
    _LIBS.append(lib)
    lib.impl("npu_fused_infer_attention_score", _fias_cpu, "CPU")
    lib_npu = torch.library.Library("npu", "FRAGMENT")  # noqa: TOR901
    _LIBS.append(lib_npu)
    lib_npu.impl("npu_fused_infer_attention_score", _fias_cpu, "CPU")
    lib_npu.impl("npu_attention_update", _attention_update_cpu, "CPU")


def _fias_cpu(query, key, value, *, atten_mask=None, actual_seq_lengths=None, actual_seq_lengths_kv=None,
              block_table=None, query_rope=None, key_rope=None, num_heads=1, scale=1.0, input_layout="BSH",
              num_key_value_heads=0, sparse_mode=0, block_size=0, softmax_lse_flag=False, **unused):
    import torch

    from dcpgraph.ops.kernels import attend

    if input_layout != "TND":
        raise NotImplementedError(f"CPU reference of FIAS: layout {input_layout}")
    if sparse_mode not in (0, 3) or (sparse_mode == 3 and atten_mask is None):
        raise NotImplementedError(f"CPU reference of FIAS: sparse_mode {sparse_mode} (mask {atten_mask is not None})")
    kv_heads = num_key_value_heads or num_heads
    q = query if query_rope is None else torch.cat([query, query_rope], -1)
    t, n, _ = query.shape
    paged = block_table is not None
    dv = value.shape[-1] // kv_heads if paged else value.shape[-1]
    out = torch.full((t, n, dv), float("nan"), dtype=query.dtype)
    lse = torch.zeros((t, n, 1), dtype=torch.float32)
    ends = [int(x) for x in actual_seq_lengths.tolist()]
    kv = [int(x) for x in actual_seq_lengths_kv.tolist()]
    start = 0
    for r, end in enumerate(ends):
        if paged:
            length = kv[r]
            blocks = block_table[r, : -(-length // block_size)].long()

            def gather(cache, heads=kv_heads, blocks=blocks, length=length):
                return cache[blocks].reshape(-1, heads, cache.shape[-1] // heads)[:length]
        else:
            k0, length = (kv[r - 1] if r else 0), kv[r] - (kv[r - 1] if r else 0)

            def gather(x, k0=k0, length=length):
                return x[k0 : k0 + length]
        if length > 0 and end > start:
            k, v = gather(key), gather(value)
            if key_rope is not None:
                k = torch.cat([k, gather(key_rope)], -1)
            o, l_ = attend(q[start:end], k, v, scale, causal=sparse_mode == 3)
            out[start:end] = o.to(out.dtype)
            lse[start:end, :, 0] = l_.to(torch.float32)
        start = end
    if not softmax_lse_flag:
        lse = torch.zeros((0,), dtype=torch.float32)
    return out, lse


def _attention_update_cpu(lse, local_out, update_type):
    import torch

    lses = torch.stack(list(lse)).to(torch.float32)  # [sp, M]
    outs = torch.stack(list(local_out)).to(torch.float32)  # [sp, M, D]
    peak = lses.max(0).values
    merged = peak + torch.log(torch.exp(lses - peak).sum(0))
    out = (torch.exp(lses - merged).unsqueeze(-1) * outs).sum(0)
    lse_out = merged if update_type == 1 else torch.full_like(lse[0], float("nan"))
    return out.to(local_out[0].dtype), lse_out


# -- reading a GE graph dump --------------------------------------------------------------------
def _attr_value(text: str):
    """A dumped AttrDef (text format, e.g. ``i: 2\\n`` or ``s: "TND"\\n``) as a Python value."""
    text = text.replace("\\n", "\n").strip()
    m = re.fullmatch(r'(s|i|f|b): (.*)', text)
    if not m:
        return text
    kind, raw = m.groups()
    if kind == "s":
        return raw.strip('"')
    if kind == "i":
        return int(raw)
    if kind == "f":
        return float(raw)
    return raw == "true"


def read_ge_dump(directory: str, stage: str = "optimized") -> list[dict]:
    """The nodes of the ``dynamo_<stage>_graph_*.pbtxt`` dump(s) in ``directory``.

    Each node: ``{"name", "op", "inputs": {input name: producer or ""}, "attrs": {key: text}}``.
    ``stage`` is ``"original"`` (straight out of the FX→GE converters) or ``"optimized"`` (after
    torchair's own GE-graph passes: what GE would compile).
    """
    files = sorted(Path(directory).glob(f"dynamo_{stage}_graph_*.pbtxt"))
    nodes = []
    for path in files:
        for chunk in re.split(r"^node \{\n", path.read_text(), flags=re.M)[1:]:
            op = re.search(r'^    op: "([^"]+)"', chunk, re.M)
            name = re.search(r'^    name: "([^"]+)"', chunk, re.M)
            inputs = re.findall(r'^    input: "([^"]*)"', chunk, re.M)
            names = [k for k in re.findall(r'key: "\[i\]([^"]+)"', chunk)]
            attrs = {k: _attr_value(v) for k, v in
                     re.findall(r"key: \"([A-Za-z_]\w*)\"\n\s+value \{\n\s+s: '([^']*)'", chunk)}
            nodes.append({"name": name.group(1) if name else "", "op": op.group(1) if op else "",
                          "inputs": dict(zip(names, inputs)), "attrs": attrs, "file": path.name})
    return nodes
