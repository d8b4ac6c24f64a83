"""Ports for listeners opened later by another process: picked outside the kernel's ephemeral range
(so no outgoing connection can be handed them before the bind), and a test server whose port was
taken anyway is restarted on a fresh one."""

from __future__ import annotations

import random
import socket

import httpx
import pytest

from dcpgraph.runtime import ports
from dcpgraph.testing import server as test_server


class Draws(random.Random):
    """A generator whose ``randrange`` returns the given ports in order, then real draws."""

    def __init__(self, *first: int) -> None:
        super().__init__(0)
        self.first = list(first)

    def randrange(self, start, stop=None, step=1):
        return self.first.pop(0) if self.first else super().randrange(start, stop, step)


def listening(port: int = 0) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", port))
    sock.listen(1)
    return sock


def test_a_picked_port_binds_and_lies_below_the_ephemeral_range():
    low, high = ports.ephemeral_range()
    assert 0 < low <= high
    for _ in range(20):
        port = ports.free_port()
        assert ports.LOWEST_PORT <= port < low
        assert ports.binds("127.0.0.1", port)


def test_a_port_someone_holds_is_passed_over():
    held = listening(ports.free_port())
    try:
        taken = held.getsockname()[1]
        assert not ports.binds("127.0.0.1", taken)
        got = ports.free_port(rng=Draws(taken, taken))
        assert got != taken and ports.binds("127.0.0.1", got)
    finally:
        held.close()


def test_without_room_below_the_ephemeral_range_the_kernel_picks(monkeypatch):
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (ports.LOWEST_PORT + 100, 60999))
    port = ports.free_port(rng=Draws())
    assert ports.binds("127.0.0.1", port)
    assert port >= ports.LOWEST_PORT + 100  # the kernel's pick, not a draw from the 100 ports below


def test_the_range_is_read_from_the_kernel_or_defaults(monkeypatch, tmp_path):
    fake = tmp_path / "range"
    fake.write_text("40000\t50000\n")
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE_FILE", str(fake))
    assert ports.ephemeral_range() == (40000, 50000)
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE_FILE", str(tmp_path / "absent"))
    assert ports.ephemeral_range() == (32768, 60999)


def test_a_server_whose_port_was_taken_before_it_bound_starts_again_on_another(monkeypatch, tmp_path):
    held = listening(ports.free_port())
    taken = held.getsockname()[1]
    picks = iter([taken])
    monkeypatch.setattr(test_server, "free_port", lambda host: next(picks, None) or ports.free_port(host))
    try:
        with test_server.running_dcpgraph("proxy", "--prefill", "http://127.0.0.1:9", "--decode",
                                          "http://127.0.0.1:9", log_path=str(tmp_path / "proxy.log"),
                                          start_timeout_s=120) as proxy:
            assert not proxy.url.endswith(f":{taken}")
            assert httpx.get(proxy.url + "/health", timeout=5).status_code == 200
        assert proxy.process.poll() is not None  # stopped by the block's exit
    finally:
        held.close()


def test_a_server_that_fails_for_another_reason_is_not_restarted(tmp_path):
    starts = []
    real_start = test_server._start

    def counting_start(*args):
        starts.append(1)
        return real_start(*args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(test_server, "_start", counting_start)
        with pytest.raises(RuntimeError, match="exited with code"):
            with test_server.running_dcpgraph("proxy", "--no-such-flag", log_path=str(tmp_path / "proxy.log"),
                                              start_timeout_s=120):
                pass
    assert len(starts) == 1
