"""The CI's slow-tier queue (.ci/slow_tier.py): every slow test file is run exactly once, in
chunks that respect the chunk budget, and a failing chunk fails the tier."""
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def slow_tier():
    spec = importlib.util.spec_from_file_location("slow_tier", ROOT / ".ci" / "slow_tier.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["slow_tier"] = module  # dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules["slow_tier"]


def test_every_file_lands_in_one_chunk_within_the_budget_longest_first(slow_tier):
    seconds = {f"tests/test_{i}.py": float(s) for i, s in enumerate([300, 200, 130, 120, 90, 60, 45, 30, 5, 1])}
    files = [*seconds, "tests/test_unrecorded.py"]
    chunks = slow_tier.chunks_longest_first(files, seconds)
    dealt = [f for c in chunks for f in c.files]
    assert sorted(dealt) == sorted(files)
    for chunk in chunks:
        cost = sum(seconds.get(f, slow_tier.DEFAULT_SECONDS) for f in chunk.files)
        assert cost == pytest.approx(chunk.seconds)
        assert len(chunk.files) == 1 or cost <= slow_tier.CHUNK_SECONDS
    totals = [c.seconds for c in chunks]
    assert totals == sorted(totals, reverse=True)
    assert len(chunks) < len(files)


def test_recorded_durations_name_files_that_exist(slow_tier):
    recorded = slow_tier.recorded_seconds()
    assert recorded, "no .ci/durations.json"
    missing = [f for f in recorded if not (ROOT / f).exists()]
    assert not missing, f"durations recorded for files that no longer exist: {missing}"


def test_a_failed_chunk_fails_the_tier_and_no_selection_does_not(slow_tier, tmp_path, capsys):
    def chunk(i, status, summary):
        log = tmp_path / f"c{i}.txt"
        log.write_text(f"..\n{summary}\n")
        return slow_tier.Chunk(i, [f"tests/test_{i}.py"], 1.0, log=log, status=status)

    passed = [chunk(0, 0, "2 passed in 1.0s"), chunk(1, 5, "no tests ran in 0.1s")]
    assert slow_tier.report(passed) == 0
    assert slow_tier.report([*passed, chunk(2, 1, "1 failed, 3 passed in 2.0s")]) == 1
    assert "5 passed, 1 failed" in capsys.readouterr().out.splitlines()[-1]
