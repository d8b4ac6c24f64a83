"""Lazy, cached builds of dcpgraph's optional C++ kernels (one :class:`NativeExtension` per source).

An extension is compiled with ``torch.utils.cpp_extension.load`` the first time :meth:`load` (or
:meth:`available`) is called, into a persistent directory: ``$DCPGRAPH_NATIVE_BUILD_DIR`` or
``~/.cache/dcpgraph/native/<hash>``. The hash covers the source's bytes, the flags, the torch
version and the CPU's feature flags, never where dcpgraph is installed: the source is compiled
from a copy inside that directory, so every installation with the same source (a checkout, an
installed wheel, another worktree) shares one build and none of them makes ninja rebuild it for
the others; a change to any hashed input gets a fresh directory. Nothing is built at import. Any
failure makes :meth:`available` return ``False`` with the reason in ``reason``; it never raises.
A source missing from the installation is a packaging error, so it also emits a
``RuntimeWarning`` naming the path. ``DCPGRAPH_NATIVE=0`` turns every extension off.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

LAYOUT = b"build-from-copy-1"  # how a build directory is laid out; part of its hash
# Reassociation for vector reductions, but never "finite math only": kernels rely on -inf and NaN
# keeping their IEEE meaning. Tuples: torch's load() appends its own flags to the lists it is
# given, which would change build_dir()'s hash after the first build; it gets fresh lists.
CFLAGS = ("-O3", "-march=native", "-ffast-math", "-fno-finite-math-only", "-fopenmp")
LDFLAGS = ("-fopenmp",)
# A build takes one to three minutes here; torch's build lock (a plain file, waited on forever)
# older than this was left by a process killed mid-build.
STALE_LOCK_SECONDS = 15 * 60


def cpu_id() -> bytes:
    """What ``-march=native`` depends on: a build is only reused on a CPU with the same flags."""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            for line in f:
                if line.startswith((b"flags", b"Features")):
                    return line
    except OSError:
        pass
    import platform

    return platform.processor().encode() + platform.machine().encode()


def clear_stale_lock(directory: Path) -> None:
    """Remove ``directory/lock`` if it is older than :data:`STALE_LOCK_SECONDS`: torch's
    ``FileBaton`` waits for it to vanish with no timeout, so a build killed while holding it would
    hang every later process that loads the kernel."""
    lock = directory / "lock"
    try:
        if time.time() - lock.stat().st_mtime > STALE_LOCK_SECONDS:
            lock.unlink()
            warnings.warn(f"removed a stale native-kernel build lock {lock}", RuntimeWarning, stacklevel=4)
    except FileNotFoundError:
        pass


class NativeExtension:
    """One C++ source built into the module ``name`` on first use; ``what`` names the kernel in
    messages (``"native paged-decode kernel"``), ``fallback`` says what runs without it."""

    def __init__(self, name: str, source: Path, what: str, fallback: str,
                 cflags: tuple[str, ...] = CFLAGS, ldflags: tuple[str, ...] = LDFLAGS, headers: tuple[Path, ...] = ()):
        self.name, self.source, self.what, self.fallback = name, Path(source), what, fallback
        self.headers = tuple(Path(h) for h in headers)  # included by the source: copied and hashed with it
        self.cflags, self.ldflags = tuple(cflags), tuple(ldflags)
        self.reason: str | None = None  # why it is unavailable (None: not tried yet, or fine)
        self.build_seconds: float | None = None  # wall time of the build/load in this process
        self.module = None
        self.tried = False
        self._lock = threading.Lock()

    def build_dir(self) -> Path:
        """The persistent build directory (created on demand by the build)."""
        tag = hashlib.sha256(
            LAYOUT + b"".join(p.read_bytes() for p in (self.source, *self.headers))
            + " ".join((*self.cflags, *self.ldflags)).encode()
            + torch.__version__.encode() + cpu_id()
        ).hexdigest()[:16]
        base = os.environ.get("DCPGRAPH_NATIVE_BUILD_DIR")
        root = Path(base) if base else Path.home() / ".cache" / "dcpgraph" / "native"
        return root / tag

    def _source_copy(self, directory: Path) -> Path:
        """The source (and its headers) copied into ``directory``, each written only when absent
        or different, so its mtime (which ninja compares) changes only with its content."""
        for original in (*self.headers, self.source):
            text = original.read_bytes()
            copy = directory / original.name
            if not copy.is_file() or copy.read_bytes() != text:
                staging = directory / f".{original.name}.{os.getpid()}.tmp"
                staging.write_bytes(text)
                os.replace(staging, copy)
        return directory / self.source.name

    def _missing_source(self) -> str | None:
        missing = [p for p in (self.source, *self.headers) if not p.is_file()]
        if not missing:
            return None
        return (
            f"{self.what} unavailable: its source {missing[0]} is missing from this installation "
            f"(dcpgraph was packaged without dcpgraph/ops/csrc/*.cpp, *.h); {self.fallback}"
        )

    def load(self):
        """The built module, or ``None`` (reason in ``reason``); builds at most once per process."""
        with self._lock:
            if self.tried:
                return self.module
            self.tried = True
            start = time.perf_counter()
            missing = self._missing_source()
            if missing is not None:
                self.reason, self.build_seconds = missing, 0.0
                warnings.warn(missing, RuntimeWarning, stacklevel=3)
                return None
            try:
                from torch.utils.cpp_extension import load

                path = self.build_dir()
                path.mkdir(parents=True, exist_ok=True)
                clear_stale_lock(path)
                self.module = load(
                    name=self.name,
                    sources=[str(self._source_copy(path))],
                    extra_cflags=list(self.cflags),
                    extra_ldflags=list(self.ldflags),
                    build_directory=str(path),
                    verbose=False,
                )
                self.reason = None
            except Exception as exc:  # noqa: BLE001 - any build/load failure only disables the kernel
                self.module = None
                self.reason = f"{self.what} unavailable: {type(exc).__name__}: {exc}"
            self.build_seconds = time.perf_counter() - start
            return self.module

    def available(self) -> bool:
        """Whether the module is built and loadable (tries the build once per process);
        ``DCPGRAPH_NATIVE=0`` says no without building."""
        if os.environ.get("DCPGRAPH_NATIVE", "1") == "0":
            return False
        return self.load() is not None


class SelfCheckedKernel:
    """A :class:`NativeExtension` whose kernel serves only after it agreed with its reference on a
    self-check; decided once per process. ``check(module)`` returns ``None`` when the kernel agrees,
    else why not (an exception counts as a failure). ``DCPGRAPH_NATIVE=0`` says no without building.
    :attr:`reason` says why the kernel is off (``None``: on, or not tried yet)."""

    def __init__(self, extension: NativeExtension, check: Callable[[Any], str | None]):
        self.extension, self._check = extension, check
        self._ok: bool | None = None
        self._lock = threading.Lock()
        self.reason: str | None = None

    def enabled(self) -> bool:
        if os.environ.get("DCPGRAPH_NATIVE", "1") == "0":
            self.reason = "native kernels turned off (DCPGRAPH_NATIVE=0)"
            return False
        with self._lock:
            if self._ok is None:
                self._ok = self._run_check()
        return self._ok

    def _run_check(self) -> bool:
        module = self.extension.load()
        if module is None:
            self.reason = self.extension.reason or f"{self.extension.what} unavailable"
            return False
        try:
            self.reason = self._check(module)
        except Exception as exc:  # noqa: BLE001 - a failing kernel is switched off, not fatal
            self.reason = f"{self.extension.what} self-check raised {type(exc).__name__}: {exc}"
        return self.reason is None
