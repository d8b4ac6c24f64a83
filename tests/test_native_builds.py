"""The native kernels build wherever they can.

Every native test skips with the build's reason when its kernel is unavailable, which is right on
a machine without a compiler, and wrong where one is present: a source that no longer compiles
would turn a hundred and more kernel tests into skips and leave the run green. These tests fail
instead, naming the compiler's error.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from dcpgraph.ops import linear, native, rms_norm, rms_norm_f32, rotary

EXTENSIONS = {
    "paged_decode": native.EXTENSION,
    "linear_bf16": linear.EXTENSION,
    "rms_norm": rms_norm.EXTENSION,  # rms_norm_bf16 and rms_norm_f32: one build
    "rotary": rotary.EXTENSION,
}


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _needs_a_compiler() -> None:
    if os.environ.get("DCPGRAPH_NATIVE", "1") == "0":
        pytest.skip("DCPGRAPH_NATIVE=0 turns the native kernels off; unset it to run this")
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler on PATH, so the native kernels cannot build here; install g++ to run this")


def test_both_rms_norm_ops_come_from_one_build():
    assert rms_norm_f32.EXTENSION is rms_norm.EXTENSION
    assert rms_norm.NATIVE.kernel is not rms_norm_f32.NATIVE.kernel  # each op keeps its own self-check


@pytest.mark.parametrize("name", list(EXTENSIONS))
def test_kernel_builds_where_a_compiler_is_present(name):
    _needs_a_compiler()
    extension = EXTENSIONS[name]
    assert extension.load() is not None, extension.reason


def test_amx_path_is_built_where_the_cpu_has_amx():
    _needs_a_compiler()
    needed = {"amx_tile", "amx_bf16", "avx512_bf16", "avx512vbmi"}
    missing = needed - _cpu_flags()
    if missing:
        pytest.skip(f"this CPU lacks {sorted(missing)}, so the AMX decode path is not compiled; an "
                    "AMX-BF16 CPU (Sapphire Rapids or later) runs this")
    if native.amx_enabled(torch.bfloat16):
        return
    if "refused the AMX tile state" in (native.amx_reason or ""):
        pytest.skip(f"the OS did not grant AMX here: {native.amx_reason}")
    pytest.fail(f"the AMX path is off on an AMX CPU: {native.amx_reason}")
