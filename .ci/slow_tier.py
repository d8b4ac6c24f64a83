"""The slow tier (``pytest -m slow``) as a queue of test files run by one or two pytest processes.

CI runs the README's default tier and the slow tier side by side on two cores. Run as one pytest
process, the slow tier outlives the default tier by half an hour, and for that half hour one
process leaves part of the machine idle (most slow tests wait on ranks, servers and sockets). Here
the slow tier's files are dealt from one queue, longest first by their recorded durations
(``durations.json``, files not listed there count as ``DEFAULT_SECONDS``), to one worker while the
default tier runs and to two once ``--second-worker-after FILE`` exists. Two pytest processes are
therefore never joined by a third: the load stays what the side-by-side run has always had.

Each worker process runs one chunk of files (a chunk's files add up to about ``CHUNK_SECONDS`` of
recorded time, so the start-up of a pytest process is paid a few dozen times, not once per file).
The exit status is 0 when every chunk passed or selected no test, else 1; every chunk's output is
printed in queue order, with its own pytest summary, and one summary line closes the run.

``--record-durations JUNIT_XML ...`` rewrites ``durations.json`` from junit files (seconds per test
file, summed), e.g. from a run with ``--junit-dir``.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DURATIONS = Path(__file__).resolve().parent / "durations.json"
DEFAULT_SECONDS = 60.0
CHUNK_SECONDS = 240.0
POLL_SECONDS = 2.0


@dataclass
class Chunk:
    """Test files run by one pytest process; ``seconds`` is their recorded total."""

    index: int
    files: list[str]
    seconds: float
    log: Path | None = None
    status: int | None = None
    wall: float = 0.0
    started: float = field(default=0.0, repr=False)


SLOW = "slow and not extended"  # the extended tier (tests/extended_tier.py) is its own run: --extended
EXTENDED = "extended"


def slow_test_files(pytest_args: list[str], marks: str = SLOW) -> list[str]:
    """The test files holding at least one test ``-m marks`` selects, in collection order."""
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", marks, "--collect-only",
                          "-p", "no:cacheprovider", *pytest_args],
                         cwd=ROOT, capture_output=True, text=True)
    if out.returncode not in (0, 5):
        sys.stdout.write(out.stdout + out.stderr)
        raise SystemExit(f"slow tier: collection failed (exit {out.returncode})")
    files: list[str] = []
    for line in out.stdout.splitlines():
        if "::" in line:
            path = line.split("::", 1)[0]
            if path not in files:
                files.append(path)
    return files


def recorded_seconds() -> dict[str, float]:
    return json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}


def chunks_longest_first(files: list[str], seconds: dict[str, float]) -> list[Chunk]:
    """Files packed first-fit decreasing into chunks of at most ``CHUNK_SECONDS`` of recorded
    time (a longer file is a chunk of its own), the chunks then ordered longest first: the last
    chunks dealt are the short ones, so the two workers finish close together."""
    ordered = sorted(files, key=lambda f: (-seconds.get(f, DEFAULT_SECONDS), f))
    bins: list[tuple[list[str], list[float]]] = []
    for path in ordered:
        cost = seconds.get(path, DEFAULT_SECONDS)
        for members, total in bins:
            if total[0] + cost <= CHUNK_SECONDS:
                members.append(path)
                total[0] += cost
                break
        else:
            bins.append(([path], [cost]))
    bins.sort(key=lambda b: -b[1][0])
    return [Chunk(i, members, total[0]) for i, (members, total) in enumerate(bins)]


def run(chunks: list[Chunk], second_worker_after: Path | None, pytest_args: list[str],
        junit_dir: Path | None, marks: str = SLOW) -> int:
    logs = Path(tempfile.mkdtemp(prefix="slow-tier-"))
    pending = list(chunks)
    running: dict[subprocess.Popen, Chunk] = {}
    while pending or running:
        workers = 2 if second_worker_after is None or second_worker_after.exists() else 1
        while pending and len(running) < workers:
            chunk = pending.pop(0)
            chunk.log = logs / f"chunk{chunk.index:02d}.txt"
            junit = [f"--junitxml={junit_dir / f'chunk{chunk.index:02d}.xml'}"] if junit_dir else []
            chunk.started = time.monotonic()
            with chunk.log.open("w") as sink:
                proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-m", marks, "-p", "no:cacheprovider",
                                         *junit, *pytest_args, *chunk.files],
                                        cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT)
            running[proc] = chunk
        time.sleep(POLL_SECONDS)
        for proc in [p for p in running if p.poll() is not None]:
            chunk = running.pop(proc)
            chunk.status, chunk.wall = proc.returncode, time.monotonic() - chunk.started
    return report(chunks)


def report(chunks: list[Chunk]) -> int:
    counts: dict[str, int] = defaultdict(int)
    failed = []
    for chunk in chunks:
        text = chunk.log.read_text() if chunk.log else ""
        print(f"---- slow chunk {chunk.index} ({len(chunk.files)} files, recorded {chunk.seconds:.0f} s, "
              f"ran {chunk.wall:.0f} s, exit {chunk.status}) ----")
        sys.stdout.write(text)
        summary = text.strip().splitlines()[-1] if text.strip() else ""
        for number, word in re.findall(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed|deselected)", summary):
            counts[word.rstrip("s") if word.startswith("error") else word] += int(number)
        if chunk.status not in (0, 5):
            failed.append(chunk.index)
    parts = ", ".join(f"{n} {w}" for w, n in counts.items() if w != "deselected")
    print(f"==== slow tier: {parts} in {len(chunks)} chunks; "
          + (f"FAILED chunks {failed}" if failed else "every chunk passed") + " ====")
    return 1 if failed else 0


def _test_file(classname: str) -> str:
    """``tests.pkg.test_x.TestClass`` -> ``tests/pkg/test_x.py``: the longest prefix that is a file."""
    parts = classname.split(".")
    for end in range(len(parts), 0, -1):
        path = "/".join(parts[:end]) + ".py"
        if (ROOT / path).exists():
            return path
    return "/".join(parts) + ".py"


def record_durations(junit_files: list[str]) -> None:
    seconds: dict[str, float] = defaultdict(float)
    for name in junit_files:
        for case in ET.parse(name).getroot().iter("testcase"):
            seconds[_test_file(case.get("classname", ""))] += float(case.get("time", 0))
    DURATIONS.write_text(json.dumps({k: round(v, 1) for k, v in sorted(seconds.items())}, indent=1) + "\n")
    print(f"wrote {DURATIONS} ({len(seconds)} files, {sum(seconds.values()) / 60:.1f} min)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--second-worker-after", type=Path,
                        help="a file whose existence lets a second pytest process start (CI: the default tier ended)")
    parser.add_argument("--junit-dir", type=Path, help="write each chunk's junit xml here")
    parser.add_argument("--extended", action="store_true",
                        help="run the extended tier (-m extended: the matrices' other cases) instead")
    parser.add_argument("--record-durations", nargs="+", metavar="JUNIT_XML",
                        help="rewrite durations.json from these junit files and exit")
    parser.add_argument("paths", nargs="*", help="test paths to draw the slow tests from (default: testpaths); "
                        "other pytest options pass through in their --option=value form")
    args, pytest_args = parser.parse_known_args(argv)
    if args.record_durations:
        record_durations(args.record_durations)
        return 0
    if args.junit_dir:
        args.junit_dir.mkdir(parents=True, exist_ok=True)
    marks = EXTENDED if args.extended else SLOW
    files = slow_test_files([*pytest_args, *args.paths], marks)
    if not files:
        print("slow tier: no test selected")
        return 0
    chunks = chunks_longest_first(files, recorded_seconds())
    return run(chunks, args.second_worker_after, pytest_args, args.junit_dir, marks)


if __name__ == "__main__":
    os.chdir(ROOT)
    raise SystemExit(main())
