"""Warm servers, the wire: how a client (:mod:`contract_lib.pool`) and a server
(:mod:`contract_lib.server`) frame what they say.

Protocol (one connection per request; pickled tuples, a 4-byte length first; file
descriptors ride with ``socket.send_fds``):

- ``("run", spec, context, fingerprint)`` with two fds (the write end of the run's
  message pipe, the run's log file): the server forks, replies ``("pid", pid)``, later
  ``("exit", code)`` (negative: signal). Closing the connection before that kills the
  run: a run dies with the process that asked for it.
- ``("server-arg-types", fingerprint)``: the kinds of value each ``ServerArgs`` field
  accepts (:mod:`contract_lib.serverargs`), so a bad server arg fails before any child.
- ``("status",)``, ``("stop",)`` (kill the runs, exit now), ``("retire",)`` (remove the
  socket, exit once the runs end).

A server whose files differ from the request's fingerprint answers ``("stale",
fingerprint)`` (see :mod:`contract_lib.pool`).
"""

from __future__ import annotations

import pickle
import socket
import struct

_HEADER = struct.Struct("!I")


def send(sock: socket.socket, obj, fds: list[int] = ()) -> None:
    """Send ``obj`` as one message (pickled, its length first), with ``fds`` if any."""
    payload = pickle.dumps(obj)
    data = _HEADER.pack(len(payload)) + payload
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.sendall(data)


def recv(sock: socket.socket, with_fds: int = 0):
    """One message and the fds that came with it; EOFError when the peer closed."""
    if with_fds:
        data, fds, _flags, _addr = socket.recv_fds(sock, 1 << 20, with_fds)
    else:
        data, fds = sock.recv(_HEADER.size), []
    if not data:
        raise EOFError("the warm server closed the connection")
    while len(data) < _HEADER.size:
        chunk = sock.recv(_HEADER.size - len(data))
        if not chunk:
            raise EOFError("the warm server closed the connection")
        data += chunk
    (size,) = _HEADER.unpack(data[:_HEADER.size])
    payload = data[_HEADER.size:]
    while len(payload) < size:
        chunk = sock.recv(size - len(payload))
        if not chunk:
            raise EOFError("the warm server closed the connection")
        payload += chunk
    return pickle.loads(payload), fds
