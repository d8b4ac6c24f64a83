"""Length-prefixed JSON frames over a socket: the only format between the driver and its workers.

A frame is a 4-byte big-endian length and that many bytes of UTF-8 JSON. Nothing is unpickled.
:func:`recv_frame` waits in short slices and calls ``alive()`` between them, so a peer process
that died is noticed within about ``poll_s`` instead of never.
"""

from __future__ import annotations

import json
import socket
import struct
import time
from collections.abc import Callable

MAX_FRAME = 64 << 20


class ChannelClosedError(ConnectionError):
    """The peer closed the connection or its process died."""


def send_frame(sock: socket.socket, message: dict) -> None:
    data = json.dumps(message, separators=(",", ":"), default=str).encode()
    sock.sendall(struct.pack(">I", len(data)) + data)


def _recv_exact(sock: socket.socket, n: int, deadline: float, alive: Callable[[], bool], poll_s: float) -> bytes:
    chunks, got = [], 0
    while got < n:
        if time.monotonic() > deadline:
            raise TimeoutError("no reply from a worker in time")
        sock.settimeout(poll_s)
        try:
            chunk = sock.recv(n - got)
        except TimeoutError:
            if not alive():
                raise ChannelClosedError("a worker process died") from None
            continue
        if not chunk:
            raise ChannelClosedError("a worker closed its connection")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def recv_frame(sock: socket.socket, *, timeout_s: float | None = None, alive: Callable[[], bool] = lambda: True,
               poll_s: float = 0.25) -> dict:
    deadline = time.monotonic() + (timeout_s if timeout_s is not None else float("inf"))
    (length,) = struct.unpack(">I", _recv_exact(sock, 4, deadline, alive, poll_s))
    if length > MAX_FRAME:
        raise ChannelClosedError(f"frame of {length} bytes exceeds {MAX_FRAME}")
    return json.loads(_recv_exact(sock, length, deadline, alive, poll_s))
