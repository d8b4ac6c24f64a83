"""Pick a TCP port for a listener that another process will open a moment later.

A port taken with ``bind(port=0)`` comes from the kernel's ephemeral range, the same range every
outgoing ``connect()`` draws its source port from. Between the pick (the probe socket closed) and
the real ``bind``, any connection on the machine (a health poll, a gloo pair, a store client) may
be handed that very port, and the listener then fails with "address already in use". Ports
*below* the ephemeral range are never handed out implicitly, so a port picked there can only be
lost to another explicit pick: :func:`free_port` draws at random from that range and keeps the
first that binds.
"""

from __future__ import annotations

import random
import socket

EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
LOWEST_PORT = 10000  # below it live well-known services; above the ephemeral range, too few ports
ATTEMPTS = 64


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for implicitly assigned ports (Linux's default where it cannot be read)."""
    try:
        with open(EPHEMERAL_RANGE_FILE) as f:
            low, high = (int(part) for part in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def binds(host: str, port: int) -> bool:
    """Whether a listener could bind ``host:port`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def free_port(host: str = "127.0.0.1", *, rng: random.Random | None = None) -> int:
    """A port on ``host`` that binds now and lies outside the ephemeral range, so no implicit
    assignment can take it before its listener binds. Falls back to a kernel-chosen port only if
    the range below the ephemeral one is too small or every draw is taken."""
    rng = rng or random.SystemRandom()
    low, _ = ephemeral_range()
    if low - LOWEST_PORT >= 1024:
        for _ in range(ATTEMPTS):
            port = rng.randrange(LOWEST_PORT, low)
            if binds(host, port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
