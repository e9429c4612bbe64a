"""Warm servers, the wire: how a client (:mod:`contract_lib.runs.pool`) and a server
(:mod:`contract_lib.child.server`) frame what they say.

Every message is JSON (a format that cannot run code when read), a 4-byte length first,
at most :data:`MAX_MESSAGE` bytes; file descriptors ride with ``socket.send_fds``. Both
sides check the peer's uid (``SO_PEERCRED``, :mod:`contract_lib.trust`) before reading a
byte from it. Protocol (one connection per request; lists on the wire):

- ``["run", spec, context, fingerprint]`` with three fds (the write end of the run's
  message pipe, the run's log file, its journal): the server forks, replies ``["pid",
  pid]``, later ``["exit", code]`` (negative: signal). Closing the connection before
  that kills the run: a run dies with the process that asked for it.
- ``["server-arg-types", fingerprint]``: the kinds of value each ``ServerArgs`` field
  accepts (:mod:`contract_lib.wire.serverargs`), so a bad server arg fails before any child.
- ``["status"]``, ``["stop"]`` (kill the runs, exit now), ``["retire"]`` (remove the
  socket, exit once the runs end).

A server whose files differ from the request's fingerprint answers ``["stale",
fingerprint]`` (see :mod:`contract_lib.runs.pool`). A message the server cannot read (not
JSON, not a request, too long, or not finished within :data:`MESSAGE_TIMEOUT_S`) closes
that connection only.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import time

_HEADER = struct.Struct("!I")
MAX_MESSAGE = 16 << 20  # bytes: a run spec with its environment is a few KB
MESSAGE_TIMEOUT_S = 10.0  # a client sends each message whole, at once
MAX_FDS = 3


class WireError(ValueError):
    """A message that breaks the protocol (its connection is closed)."""


def encode(obj) -> bytes:
    payload = json.dumps(obj, separators=(",", ":")).encode()
    if len(payload) > MAX_MESSAGE:
        raise WireError(f"a message of {len(payload)} bytes (limit {MAX_MESSAGE})")
    return _HEADER.pack(len(payload)) + payload


def decode(payload: bytes):
    try:
        return json.loads(payload)
    except (UnicodeDecodeError, ValueError) as exc:
        raise WireError(f"not a JSON message ({exc})") from exc


def send(sock: socket.socket, obj, fds: list[int] = ()) -> None:
    """Send ``obj`` as one message, with ``fds`` if any."""
    data = encode(obj)
    if fds:
        sent = socket.send_fds(sock, [data], list(fds))
        if sent < len(data):
            sock.sendall(data[sent:])
    else:
        sock.sendall(data)


def _read_exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise EOFError("the warm server closed the connection")
        data += chunk
    return data


def recv(sock: socket.socket):
    """One message from a server whose peer was checked (client side, blocking);
    EOFError when the peer closed, :class:`WireError` when it broke the protocol."""
    (size,) = _HEADER.unpack(_read_exactly(sock, _HEADER.size))
    if size > MAX_MESSAGE:
        raise WireError(f"the warm server announced a message of {size} bytes")
    return decode(_read_exactly(sock, size))


class Incoming:
    """A server's reader of one connection: bytes and fds gathered as they arrive,
    without blocking, into whole messages."""

    def __init__(self) -> None:
        self.buffer = b""
        self.fds: list[int] = []
        self.started: float | None = None  # when the pending message's first byte came

    def feed(self, sock: socket.socket) -> bool:
        """Read what is there; False when the peer closed. Raises :class:`WireError`
        for a message over the limit."""
        data, fds, _flags, _addr = socket.recv_fds(sock, 1 << 16, MAX_FDS)
        self.fds += fds
        if not data:
            return False
        if self.started is None:
            self.started = time.monotonic()
        self.buffer += data
        if len(self.buffer) >= _HEADER.size:
            (size,) = _HEADER.unpack(self.buffer[:_HEADER.size])
            if size > MAX_MESSAGE:
                raise WireError(f"a message of {size} bytes (limit {MAX_MESSAGE})")
        return True

    def message(self):
        """The next whole message and its fds (taken from this reader), or None."""
        if len(self.buffer) < _HEADER.size:
            return None
        (size,) = _HEADER.unpack(self.buffer[:_HEADER.size])
        end = _HEADER.size + size
        if len(self.buffer) < end:
            return None
        payload, self.buffer = self.buffer[_HEADER.size:end], self.buffer[end:]
        fds, self.fds = self.fds, []
        self.started = time.monotonic() if self.buffer else None
        try:
            return decode(payload), fds
        except WireError:
            close_fds(fds)
            raise

    def overdue(self, now: float, timeout: float = MESSAGE_TIMEOUT_S) -> bool:
        """A message begun more than ``timeout`` seconds ago is still incomplete."""
        return self.started is not None and now - self.started > timeout

    def close(self) -> None:
        close_fds(self.fds)
        self.fds = []


def close_fds(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
