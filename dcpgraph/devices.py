"""Where ranks run: ``--device auto|cpu|cuda|npu``, resolved once on the front end, and each
worker's placement (its device and its collective backend).

* ``auto``: an Ascend NPU if ``torch_npu`` imports and sees one, else CUDA if torch sees a GPU,
  else the CPU.
* A rank with local index ``i`` on its node runs on ``{kind}:{i mod count}`` (one accelerator per
  rank, round robin where ranks outnumber devices) and its collectives use the kind's backend:
  NCCL for CUDA, HCCL for NPU, gloo for the CPU.

What the machine has is asked through one object, :class:`DeviceProbe`, so a test can fake a CUDA
or NPU machine and check placement and backends without one. ``torch_npu`` is imported only when
its distribution is installed, and a failed import counts as no NPU (it needs Ascend's CANN
libraries; on a machine without them it cannot load).
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass

import torch

from .errors import ConfigError

DEVICE_CHOICES = ("auto", "cpu", "cuda", "npu")
BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
AUTO_ORDER = ("npu", "cuda")  # auto picks the first kind the machine has, else the CPU


class DeviceProbe:
    """The machine as torch sees it: how many devices of a kind (and why none), and making one
    the process's current device."""

    def count(self, kind: str) -> tuple[int, str]:
        """``(devices of kind, why none when 0)``; the CPU counts as one."""
        if kind == "cpu":
            return 1, ""
        if kind == "cuda":
            if not torch.cuda.is_available():
                return 0, "torch.cuda.is_available() is False (a CPU build of torch, or no visible GPU)"
            return torch.cuda.device_count(), ""
        if kind == "npu":
            return self._npu_count()
        raise ConfigError(f"unknown device kind {kind!r}; valid: {list(BACKENDS)}")

    @staticmethod
    def _npu_count() -> tuple[int, str]:
        if importlib.util.find_spec("torch_npu") is None:
            return 0, "torch_npu is not installed"
        try:
            importlib.import_module("torch_npu")
        except Exception as err:  # noqa: BLE001 - any failure to load means no usable NPU
            return 0, f"torch_npu does not import ({type(err).__name__}: {err}); it needs Ascend's CANN libraries"
        npu = getattr(torch, "npu", None)
        if npu is None or not npu.is_available():
            return 0, "torch.npu.is_available() is False"
        return npu.device_count(), ""

    def set_device(self, device: str) -> None:
        """Make ``device`` (``"cuda:1"``) the process's current accelerator (a no-op for the CPU)."""
        kind = device.split(":")[0]
        if kind != "cpu":
            getattr(torch, kind).set_device(device)


@dataclass(frozen=True)
class DeviceKind:
    """A resolved device kind and how many of it a node has."""

    name: str  # "cpu", "cuda" or "npu"
    count: int = 1

    @property
    def backend(self) -> str:
        return BACKENDS[self.name]

    def for_local_rank(self, local_rank: int) -> str:
        """The device of the rank with index ``local_rank`` among its node's ranks, by name
        (``"npu:1"`` is a name torch parses only once ``torch_npu`` is imported)."""
        if self.name == "cpu":
            return "cpu"
        return f"{self.name}:{local_rank % self.count}"


@dataclass(frozen=True)
class RankPlacement:
    """One worker's device and the backend its process group uses."""

    device: str  # "cpu", "cuda:1", "npu:0"
    backend: str


def resolve_device(choice: str, probe: DeviceProbe | None = None) -> DeviceKind:
    """``choice`` (one of :data:`DEVICE_CHOICES`) as the kind this machine runs. An accelerator
    asked for by name that the machine does not have is a :class:`ConfigError` naming why and what
    is available, raised before any worker or collective starts."""
    if choice not in DEVICE_CHOICES:
        raise ConfigError(f"device must be one of {list(DEVICE_CHOICES)}, got {choice!r}")
    probe = probe or DeviceProbe()
    if choice == "auto":
        for kind in AUTO_ORDER:
            count, _ = probe.count(kind)
            if count:
                return DeviceKind(kind, count)
        return DeviceKind("cpu")
    count, why = probe.count(choice)
    if not count:
        present = ["cpu"] + [k for k in AUTO_ORDER if probe.count(k)[0]]
        raise ConfigError(f"device={choice!r}: no {choice} device here ({why}); available: {present}")
    return DeviceKind(choice, count)


def place_rank(kind: DeviceKind, local_rank: int, probe: DeviceProbe | None = None) -> RankPlacement:
    """Make the rank's device current (before its process group starts, as NCCL and HCCL need)
    and say which backend its group uses."""
    device = kind.for_local_rank(local_rank)
    (probe or DeviceProbe()).set_device(device)
    return RankPlacement(device, kind.backend)
