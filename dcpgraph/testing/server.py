"""Start ``dcpgraph serve`` in a subprocess on a free 127.0.0.1 port, and stop it (tests, benchmarks)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from ..runtime.ports import free_port

__all__ = ["ServerProcess", "free_port", "running_dcpgraph", "running_server", "running_servers"]
START_ATTEMPTS = 3  # fresh ports for a server whose own port was taken before it bound


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

    def wait_down(self, timeout_s: float = 30.0) -> None:
        """Wait (bounded) until ``/health`` answers 503, then check that a new completion is
        refused with 503 ``service_unavailable``: what a server whose engine died must do."""
        import httpx

        deadline = time.monotonic() + timeout_s
        while httpx.get(self.url + "/health", timeout=10).status_code != 503:
            if time.monotonic() > deadline:
                raise AssertionError(f"/health still OK {timeout_s:.0f} s after the engine died")
            time.sleep(0.25)
        r = httpx.post(self.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
        if r.status_code != 503 or r.json()["error"]["type"] != "service_unavailable":
            raise AssertionError(f"a new request after the engine died got {r.status_code}: {r.text[:200]}")


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
    for attempt in range(START_ATTEMPTS):
        server = _start(subcommand, args, log_path, env)
        try:
            _wait_healthy(server, start_timeout_s)
            break
        except BaseException as err:
            _stop(server)
            if not isinstance(err, _PortTaken) or attempt + 1 == START_ATTEMPTS:
                raise
    try:
        yield server
    finally:
        _stop(server)


@contextlib.contextmanager
def running_servers(*servers: tuple[tuple[str, ...], str], start_timeout_s: float = 600.0):
    """Several ``dcpgraph serve`` processes, each ``(args, log_path)``: all start at once (their
    start-ups overlap), then each is waited for as :func:`running_server` does; yields them in
    order and stops them all when the block exits."""
    started: list[ServerProcess] = []
    try:
        started += [_start("serve", args, log_path, None) for args, log_path in servers]
        for i, (args, log_path) in enumerate(servers):
            for attempt in range(START_ATTEMPTS):
                try:
                    _wait_healthy(started[i], start_timeout_s)
                    break
                except _PortTaken:
                    _stop(started[i])
                    if attempt + 1 == START_ATTEMPTS:
                        raise
                    started[i] = _start("serve", args, log_path, None)
        yield list(started)
    finally:
        for server in started:
            _stop(server)


class _PortTaken(RuntimeError):
    """The server exited because its own port was bound by someone else first."""


def _start(subcommand: str, args: tuple[str, ...], log_path: str, env: dict | None) -> ServerProcess:
    port = free_port("127.0.0.1")
    command = [sys.executable, "-m", "dcpgraph", subcommand, *args, "--host", "127.0.0.1", "--port", str(port)]
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    return ServerProcess(f"http://127.0.0.1:{port}", process, log_path)


def _port_of(server: ServerProcess) -> int:
    return int(server.url.rsplit(":", 1)[1])


def _wait_healthy(server: ServerProcess, start_timeout_s: float) -> None:
    """Poll ``/health`` until 200 (bounded). Raises :class:`_PortTaken` if the server exited on
    its own port being in use, ``RuntimeError`` with its log if it exited otherwise, and
    ``TimeoutError`` with its log past the deadline."""
    import httpx

    deadline = time.monotonic() + start_timeout_s
    while True:
        if server.process.poll() is not None:
            log = server.log()
            clashes = [line for line in log.lower().splitlines() if "address already in use" in line]
            if any(str(_port_of(server)) in line for line in clashes):
                raise _PortTaken(f"port {_port_of(server)} was taken before the server bound it:\n{log[-2000:]}")
            raise RuntimeError(f"the server exited with code {server.process.returncode}:\n{log[-4000:]}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the server was not healthy within {start_timeout_s} s:\n{server.log()[-4000:]}")
        try:
            if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)


def _stop(server: ServerProcess) -> None:
    """SIGTERM, then SIGKILL after 30 s; then any worker the server logged and could not stop."""
    process = server.process
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
