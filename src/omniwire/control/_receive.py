"""Frames in: the bound PULL socket, drained in batches with its file descriptor
watched directly, and the reads pending on the plane's sockets."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import zmq
import zmq.asyncio

from ..errors import EndpointClosedError
from ._sockets import Sockets, closed_error, fail_all


class Inbox:
    """The PULL socket (see :class:`ControlPlane`'s ``recv_many``), and every read
    pending on it or on the SUB. The caller checks that the plane is open."""

    def __init__(self, sockets: Sockets) -> None:
        self._sockets = sockets
        self.pull: zmq.asyncio.Socket | None = None
        self._reads: set[asyncio.Future[Any]] = set()  # pending recv / recv_abort

    async def recv_many(self, limit: int) -> list[bytes]:
        pull = self.pull
        assert pull is not None
        while True:
            frames: list[bytes] = []
            try:
                while len(frames) < limit:
                    frames.append(zmq.Socket.recv(pull, zmq.DONTWAIT))
            except zmq.Again:
                pass
            except zmq.ZMQError as exc:
                raise EndpointClosedError(f"control plane is closed: {exc}") from exc
            if frames:
                return frames
            await self._readable(pull)

    async def _readable(self, sock: zmq.asyncio.Socket) -> None:
        """Wait until ``sock`` has a frame (its FD signals, ZMQ_EVENTS says POLLIN)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        fd = cast(int, zmq.Socket.getsockopt(sock, zmq.FD))

        def check() -> None:  # the FD only says "look": ZMQ_EVENTS tells (and re-arms it)
            if fut.done():
                return
            try:
                if cast(int, zmq.Socket.getsockopt(sock, zmq.EVENTS)) & zmq.POLLIN:
                    fut.set_result(None)
            except zmq.ZMQError as exc:
                fut.set_exception(EndpointClosedError(f"control plane is closed: {exc}"))

        self._reads.add(fut)
        loop.add_reader(fd, check)
        try:
            check()  # a frame may have arrived between the last recv and add_reader
            await fut
        finally:
            loop.remove_reader(fd)
            self._reads.discard(fut)

    async def read(self, sock: zmq.asyncio.Socket) -> bytes:
        """The next frame of ``sock``, one at a time (through pyzmq's futures)."""
        try:
            fut = cast("asyncio.Future[bytes]", sock.recv())
        except zmq.ZMQError as exc:
            raise EndpointClosedError(f"control plane is closed: {exc}") from exc
        self._reads.add(fut)
        try:
            return await fut
        except zmq.ZMQError as exc:
            raise EndpointClosedError(f"control plane is closed: {exc}") from exc
        finally:
            self._reads.discard(fut)

    def fail_reads(self) -> None:
        fail_all(self._reads, closed_error)

    def close(self) -> None:
        self._sockets.close(self.pull)
        self.pull = None
