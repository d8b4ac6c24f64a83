"""Start ``dcpgraph serve`` in a subprocess on a free 127.0.0.1 port, and stop it (tests, benchmarks)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class ServerProcess:
    url: str  # http://127.0.0.1:PORT
    process: subprocess.Popen
    log_path: str

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def worker_pids(self) -> list[int]:
        """The worker pids the server logged at startup (empty at tp=1)."""
        match = re.search(r"pids \[([\d, ]+)\]", self.log())
        return [int(p) for p in match.group(1).split(",")] if match else []


@contextlib.contextmanager
def running_server(model_dir: str, *args: str, log_path: str, start_timeout_s: float = 600.0,
                   env: dict | None = None):
    """``dcpgraph serve model_dir *args`` until the block exits; waits for ``/health`` (bounded),
    raising with the server's log if it exits or times out first. Stops it with SIGTERM (then
    SIGKILL after 30 s)."""
    with running_dcpgraph("serve", model_dir, *args, log_path=log_path, start_timeout_s=start_timeout_s,
                          env=env) as server:
        yield server


@contextlib.contextmanager
def running_dcpgraph(subcommand: str, *args: str, log_path: str, start_timeout_s: float = 600.0,
                     env: dict | None = None):
    """``dcpgraph <subcommand> *args --host 127.0.0.1 --port <free>`` (``serve``, ``proxy``) as
    :func:`running_server` describes."""
    import httpx

    port = free_port()
    command = [sys.executable, "-m", "dcpgraph", subcommand, *args, "--host", "127.0.0.1", "--port", str(port)]
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    server = ServerProcess(f"http://127.0.0.1:{port}", process, log_path)
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"the server exited with code {process.returncode}:\n{server.log()[-4000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server was not healthy within {start_timeout_s} s:\n{server.log()[-4000:]}")
            try:
                if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        yield server
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)
        for pid in server.worker_pids():  # a worker the server could not stop (only after SIGKILL)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
