"""ZMTP 3.0 spoken by hand over a plain TCP socket (NULL mechanism), for tests of
peers that do what libzmq would not: send data down a PUSH socket, send a PING
right behind a flood, reset the connection with data unread.

Frames per ZeroMQ RFC 23: greeting (signature, version 3.0, mechanism, as-server),
READY command with a ``Socket-Type`` property, then messages (flags, size, body)."""

from __future__ import annotations

import socket
import struct


def greeting(*, as_server: bool) -> bytes:
    return (
        b"\xff" + b"\x00" * 8 + b"\x7f"  # signature
        + b"\x03\x00"  # version 3.0
        + b"NULL".ljust(20, b"\x00")
        + (b"\x01" if as_server else b"\x00")
        + b"\x00" * 31
    )  # fmt: skip


def command(name: bytes, body: bytes = b"") -> bytes:
    payload = bytes([len(name)]) + name + body
    return _frame(payload, flags=0x04)


def ready(socket_type: bytes) -> bytes:
    prop = b"\x0bSocket-Type" + struct.pack(">I", len(socket_type)) + socket_type
    return command(b"READY", prop)


def ping(ttl_deciseconds: int = 0) -> bytes:
    return command(b"PING", struct.pack(">H", ttl_deciseconds))


def message(body: bytes) -> bytes:
    return _frame(body, flags=0x00)


def _frame(body: bytes, *, flags: int) -> bytes:
    if len(body) <= 255:
        return bytes([flags, len(body)]) + body
    return bytes([flags | 0x02]) + struct.pack(">Q", len(body)) + body


def handshake(sock: socket.socket, socket_type: bytes, *, as_server: bool) -> None:
    """Send our greeting and READY; read the peer's greeting and READY (not checked
    beyond their length: the peer is libzmq)."""
    sock.sendall(greeting(as_server=as_server))
    _read_exact(sock, 64)
    sock.sendall(ready(socket_type))
    flags, size = _read_exact(sock, 2)
    if flags & 0x02:
        size = struct.unpack(">Q", bytes([size]) + _read_exact(sock, 7))[0]
    _read_exact(sock, size)


def reset(sock: socket.socket) -> None:
    """Close with an RST (SO_LINGER 0), as a crashed peer's kernel would with data
    unread."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def _read_exact(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise ConnectionError("the peer closed during the ZMTP handshake")
        out += chunk
    return bytes(out)
