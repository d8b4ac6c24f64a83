"""dcpgraph as a user installs it (``pip install .``, not ``-e``).

1. A wheel built from the project ships the native kernel's C++ source, and from the installed
   copy (no checkout on ``sys.path``) the kernel builds and passes its self-check against the
   torch path. One compile (about a minute): marked ``slow``, still in the default run.
2. An installation without the source says so (a ``RuntimeWarning`` and the reason) instead of
   silently running the torch path.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from dcpgraph.ops import native, paged
from dcpgraph.ops.native_build import NativeExtension

REPO = Path(__file__).resolve().parents[1]
SOURCE_IN_WHEEL = "dcpgraph/ops/csrc/paged_decode.cpp"

# Run in a fresh interpreter whose cwd holds no dcpgraph: the installed copy (argv[1]) goes first
# on sys.path, so neither the checkout nor the editable install can be what gets imported.
_CHECK_INSTALLED = """
import json, sys
sys.path.insert(0, sys.argv[1])
import dcpgraph
from dcpgraph.ops import native, paged
enabled = paged.native_enabled()
print(json.dumps({
    "dcpgraph": dcpgraph.__file__,
    "source": str(native._SRC),
    "build_dir": str(native.build_dir()),
    "module": getattr(native._module, "__file__", None),
    "enabled": enabled,
    "reason": paged._native_state.get("reason"),
}))
"""


def _pip(*args: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pip", *args, "--disable-pip-version-check", "-q"],
        capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, f"pip {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}"


def _copy_project(dest: Path) -> None:
    """The files a wheel is built from, so the build's scratch (build/, *.egg-info) stays out of
    the checkout and concurrent runs cannot share it."""
    dest.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, dest / name)
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so", "*.egg-info")
    shutil.copytree(REPO / "dcpgraph", dest / "dcpgraph", ignore=skip)


@pytest.mark.slow
def test_wheel_ships_the_kernel_source_and_the_installed_copy_builds_it(tmp_path):
    project, wheels, site, build_root = (tmp_path / n for n in ("project", "wheels", "site", "native"))
    _copy_project(project)
    _pip("wheel", str(project), "--no-deps", "--no-build-isolation", "-w", str(wheels))
    (wheel,) = wheels.glob("dcpgraph-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        assert SOURCE_IN_WHEEL in archive.namelist(), "the wheel lacks the native kernel source"
        assert archive.read(SOURCE_IN_WHEEL) == (REPO / SOURCE_IN_WHEEL).read_bytes()

    _pip("install", "--no-deps", "--target", str(site), str(wheel))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "DCPGRAPH_NATIVE")}
    env["DCPGRAPH_NATIVE_BUILD_DIR"] = str(build_root)  # a fresh build, not the user's cache
    done = subprocess.run(
        [sys.executable, "-c", _CHECK_INSTALLED, str(site)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900,
    )
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])

    assert Path(got["dcpgraph"]).is_relative_to(site), got["dcpgraph"]
    assert Path(got["source"]).is_relative_to(site) and Path(got["source"]).is_file()
    assert got["enabled"] and got["reason"] is None, got["reason"]
    build = Path(got["build_dir"])
    assert build.parent == build_root and Path(got["module"]).is_relative_to(build)
    # The build is keyed by the source's content, not its location: this checkout's copy of the
    # same source maps to the same directory name, and the build compiled a copy kept inside the
    # directory, so neither installation makes ninja rebuild (clobber) the other's kernel.
    assert build.name == native.build_dir().name
    assert (build / "paged_decode.cpp").read_bytes() == (REPO / SOURCE_IN_WHEEL).read_bytes()
    assert str(site) not in (build / "build.ninja").read_text()


def test_a_missing_kernel_source_is_reported_not_silent(monkeypatch, tmp_path):
    missing = tmp_path / "csrc" / "paged_decode.cpp"
    monkeypatch.setattr(native, "_SRC", missing)
    fresh = NativeExtension(native.EXTENSION.name, missing, native.EXTENSION.what, native.EXTENSION.fallback)
    monkeypatch.setattr(native, "EXTENSION", fresh)
    monkeypatch.setattr(paged, "_native_state", {})
    monkeypatch.delenv("DCPGRAPH_NATIVE", raising=False)
    with pytest.warns(RuntimeWarning, match="is missing from this installation"):
        assert not paged.native_enabled()
    assert str(missing) in paged._native_state["reason"]
    assert native.reason == paged._native_state["reason"] and "torch path" in native.reason
    assert not native.available()  # decided once per process; no second build attempt


def test_a_stale_build_lock_is_removed_and_a_fresh_one_kept(tmp_path):
    """torch's build lock is waited on forever; one left by a killed build must not hang loads."""
    import os
    import time
    import warnings

    from dcpgraph.ops import native

    lock = tmp_path / "lock"
    lock.write_text("")
    native._clear_stale_lock(tmp_path)
    assert lock.exists()  # a build may hold it right now
    old = time.time() - native.STALE_LOCK_SECONDS - 60
    os.utime(lock, (old, old))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        native._clear_stale_lock(tmp_path)
    assert not lock.exists()
    assert any("stale native-kernel build lock" in str(w.message) for w in caught)
