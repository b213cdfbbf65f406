"""The raw ``zmq.asyncio`` baselines: what the same traffic costs on bare sockets.

The other process (``python -m omniwire.bench._rawzmq BASE``, asyncio, no torch)
binds three PULL sockets and connects one PUSH back to this process; each PULL
is served by its own task, as tight as an application would write it. ``BASE`` is
an ``ipc://`` path prefix (both processes on this host), or ``tcp://IP BACK``: the
other process binds on ``IP`` (another host of ``omniwire bench --namespaces``),
says where on its READY line, and connects back to ``BACK``.

- ``BASE-echo``: every message is sent back as it came;
- ``BASE-count``: messages are counted; one whose first byte is ``L`` (the last)
  is answered with the count (ASCII) and the count restarts;
- ``BASE-mix``: every message starts with ``MIX_HEADER`` (the sender's
  ``time.monotonic_ns()``, a last-of-its-stream flag, the number of streams);
  the receiver keeps ``now - t`` per message (``CLOCK_MONOTONIC`` is one clock for
  every process of a host) and, once every stream sent its last message, answers
  with the latencies (int64 ns, native order) and starts over.

:class:`RawZmq` is this process's side: one PUSH per PULL (each ``send`` awaited,
one at a time per caller) and the PULL the answers come back on.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import os
import secrets
import signal
import struct
import sys
import time
from collections.abc import Sequence

import zmq
import zmq.asyncio

__all__ = ["MIX_HEADER", "RawZmq"]

#: t (monotonic ns), last of its stream (0/1), streams in the round
MIX_HEADER = struct.Struct("<qBH")
LAST = b"L"


# -- the other process --------------------------------------------------------------


async def _echo(pull: zmq.asyncio.Socket, back: zmq.asyncio.Socket) -> None:
    while True:
        await back.send(await pull.recv())


async def _count(pull: zmq.asyncio.Socket, back: zmq.asyncio.Socket) -> None:
    n = 0
    while True:
        msg = await pull.recv()
        n += 1
        if msg[:1] == LAST:
            await back.send(str(n).encode())
            n = 0


async def _mix(pull: zmq.asyncio.Socket, back: zmq.asyncio.Socket) -> None:
    latencies = array.array("q")
    ended = 0
    while True:
        msg = await pull.recv()
        now = time.monotonic_ns()
        sent, last, streams = MIX_HEADER.unpack_from(msg)
        latencies.append(now - sent)
        if last:
            ended += 1
            if ended == streams:
                await back.send(latencies.tobytes())
                latencies = array.array("q")
                ended = 0


_NAMES = ("echo", "count", "mix")


async def serve(base: str, back_address: str | None = None) -> None:
    """Serve the three baselines until SIGTERM/SIGINT (over TCP when ``back_address``
    is given: ``base`` is then ``tcp://IP``)."""
    ctx = zmq.asyncio.Context()
    back = ctx.socket(zmq.PUSH)
    back.connect(back_address or f"{base}-back")
    pulls = []
    for name in _NAMES:
        s = ctx.socket(zmq.PULL)
        s.bind(f"{base}:0" if back_address else f"{base}-{name}")
        pulls.append(s)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    tasks = [
        asyncio.create_task(fn(s, back)) for fn, s in zip((_echo, _count, _mix), pulls, strict=True)
    ]
    where = " ".join(str(s.getsockopt_string(zmq.LAST_ENDPOINT)) for s in pulls)
    print(f"READY {where}" if back_address else "READY", flush=True)
    await stop.wait()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for s in (*pulls, back):
        s.close(0)
    ctx.term()
    for name in _NAMES:
        _unlink(f"{base}-{name}")


def _unlink(address: str) -> None:
    """Remove the socket file of an ``ipc://`` address this process bound."""
    if address.startswith("ipc://"):
        with contextlib.suppress(OSError):
            os.unlink(address[len("ipc://") :])


# -- this process's side -------------------------------------------------------------


class RawZmq:
    """Sockets to a running baseline process (see the module docstring).

    Make it inside the event loop: bind the answers' socket (``ipc://`` base: at
    ``BASE-back``; ``tcp://IP``: on a free port, :attr:`back_address`), start the
    other process, then :meth:`connect` to its sockets (at ``BASE-NAME``, or where
    its READY line said).
    """

    def __init__(self, base: str) -> None:
        self.base = base
        self.pid = 0
        self.ctx = zmq.asyncio.Context()
        self.back = self.ctx.socket(zmq.PULL)
        self.back.bind(f"{base}:0" if base.startswith("tcp://") else f"{base}-back")
        self.back_address = str(self.back.getsockopt_string(zmq.LAST_ENDPOINT))

    def connect(self, pid: int, where: Sequence[str] = ()) -> None:
        """Connect to the other process ``pid``, bound at ``where`` (its READY line's
        three addresses) or at ``BASE-NAME``."""
        self.pid = pid
        addresses = list(where) or [f"{self.base}-{name}" for name in _NAMES]
        #: where the other process serves (for the report)
        self.peer_addresses = addresses
        self.echo_push, self.count_push, self.mix_push = (self._push(a) for a in addresses)

    def _push(self, address: str) -> zmq.asyncio.Socket:
        s = self.ctx.socket(zmq.PUSH)
        s.connect(address)
        return s

    async def echo(self, msg: bytes) -> bytes:
        """One round trip of ``msg``; returns what came back."""
        await self.echo_push.send(msg)
        return await self.back.recv()

    async def stream(self, msg: bytes, last: bytes, n: int) -> int:
        """``n - 1`` times ``msg`` then ``last`` (first byte ``L``), each send awaited;
        returns the count the other side answered with."""
        push = self.count_push
        for _ in range(n - 1):
            await push.send(msg)
        await push.send(last)
        return int(await self.back.recv())

    async def mix_chunk(self, payload: bytes, last: bool, streams: int) -> None:
        """One message of the mix: the header (sent now) and ``payload``."""
        header = MIX_HEADER.pack(time.monotonic_ns(), last, streams)
        await self.mix_push.send(header + payload)

    async def mix_latencies(self) -> Sequence[int]:
        """The latencies (ns) the other side reports once every stream ended."""
        return array.array("q", await self.back.recv())

    def close(self) -> None:
        pushes = [getattr(self, n, None) for n in ("echo_push", "count_push", "mix_push")]
        for s in (*pushes, self.back):
            if s is not None:
                s.close(0)
        self.ctx.term()
        _unlink(f"{self.base}-back")


def new_base() -> str:
    from ._procs import ipc_base

    return ipc_base(f"zmq-{secrets.token_hex(3)}")


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) not in (1, 2) or (len(args) == 2) != args[0].startswith("tcp://"):
        print("usage: python -m omniwire.bench._rawzmq ipc://BASE | tcp://IP BACK", file=sys.stderr)
        return 2
    asyncio.run(serve(args[0], args[1] if len(args) == 2 else None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
