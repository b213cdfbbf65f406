"""Frames in: the bound PULL socket, drained in batches with its file descriptor
watched directly, and the reads pending on the plane's sockets.

A caller of ``recv_many`` may pass ``apply``: frames that arrive while it waits are
then handed to ``apply`` right in the socket's reader callback, and the waiting task
is woken only for what ``apply`` left (or when more may be queued than one callback
takes). An idle endpoint so takes a frame in one turn of the event loop, not two:
the callback, then the waiting task."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, cast

import zmq
import zmq.asyncio

from .. import hops
from ..errors import EndpointClosedError, reason_text
from ._sockets import Sockets, closed_error, fail_all, remove_reader

#: As a plain int: ``int & zmq.POLLIN`` builds an IntFlag (~2 µs, at every wake-up).
_POLLIN = int(zmq.POLLIN)


def _closed(exc: zmq.ZMQError) -> EndpointClosedError:
    return EndpointClosedError(f"control plane is closed: {reason_text(exc, 'socket error')}")


class Inbox:
    """The PULL socket (see :class:`ControlPlane`'s ``recv_many``), and every read
    pending on it or on the SUB. The caller checks that the plane is open."""

    def __init__(self, sockets: Sockets) -> None:
        self._sockets = sockets
        self.pull: zmq.asyncio.Socket | None = None
        self._reads: set[asyncio.Future[Any]] = set()  # pending recv / recv_abort
        #: The PULL socket's FD stays registered with the loop from the first wait on
        #: (registering and unregistering it per wait cost ~10 µs): (loop, fd, socket).
        self._watch: tuple[asyncio.AbstractEventLoop, int, zmq.asyncio.Socket] | None = None
        self._waiter: asyncio.Future[None] | None = None  # the recv_many waiting, if any
        #: While a recv_many with ``apply`` waits: ``apply`` and its ``limit``.
        self._apply: tuple[Callable[[list[bytes]], list[bytes]], int] | None = None
        self._left: list[bytes] = []  # frames ``apply`` left, for the waiting recv_many

    async def recv_many(
        self, limit: int, apply: Callable[[list[bytes]], list[bytes]] | None = None
    ) -> list[bytes]:
        pull = self.pull
        assert pull is not None
        while True:
            if self._left:
                frames, self._left = self._left, []
                return frames
            frames = self._drain(pull, limit)
            if frames:
                return frames
            self._apply = None if apply is None else (apply, limit)
            try:
                await self._readable(pull)
            finally:
                self._apply = None

    @staticmethod
    def _drain(pull: zmq.asyncio.Socket, limit: int) -> list[bytes]:
        """Up to ``limit`` frames queued at ``pull``, without waiting."""
        frames: list[bytes] = []
        try:
            while len(frames) < limit:
                frames.append(zmq.Socket.recv(pull, zmq.DONTWAIT))
        except zmq.Again:
            pass
        except zmq.ZMQError as exc:
            raise _closed(exc) from exc
        if frames:
            hops.mark("frames in")
        return frames

    async def _readable(self, sock: zmq.asyncio.Socket) -> None:
        """Wait until ``sock`` has a frame (its FD signals, ZMQ_EVENTS says POLLIN)."""
        loop = asyncio.get_running_loop()
        watch = self._watch
        if watch is None or watch[0] is not loop or watch[2] is not sock:
            self._unwatch()
            fd = cast(int, zmq.Socket.getsockopt(sock, zmq.FD))
            loop.add_reader(fd, self._check)
            self._watch = (loop, fd, sock)
        fut: asyncio.Future[None] = loop.create_future()
        self._waiter = fut
        self._reads.add(fut)
        try:
            self._check()  # a frame may have arrived between the last recv and now
            await fut
        finally:
            self._waiter = None
            self._reads.discard(fut)

    def _check(self) -> None:
        """The FD only says "look": ZMQ_EVENTS tells, and re-arms it — read it also
        when nobody waits (frames being applied), else the FD stays readable and the
        loop would call this every turn."""
        watch = self._watch
        if watch is None:
            return
        fut = self._waiter
        try:
            ready = cast(int, zmq.Socket.getsockopt(watch[2], zmq.EVENTS)) & _POLLIN
        except zmq.ZMQError as exc:
            if fut is not None and not fut.done():
                fut.set_exception(_closed(exc))
            return
        if not ready or fut is None or fut.done():
            return
        if self._apply is None:
            fut.set_result(None)
            return
        apply, limit = self._apply
        try:
            frames = self._drain(watch[2], limit)
            left = apply(frames) if frames else []
        except BaseException as exc:  # closed meanwhile; or a bug: the waiter raises it
            fut.set_exception(exc)
            return
        if left or len(frames) == limit:  # what apply left, or maybe more queued
            self._left = left
            fut.set_result(None)

    def _unwatch(self) -> None:
        watch, self._watch = self._watch, None
        if watch is not None:
            remove_reader(watch[0], watch[1])

    async def read(self, sock: zmq.asyncio.Socket) -> bytes:
        """The next frame of ``sock``, one at a time (through pyzmq's futures)."""
        try:
            fut = cast("asyncio.Future[bytes]", sock.recv())
        except zmq.ZMQError as exc:
            raise _closed(exc) from exc
        self._reads.add(fut)
        try:
            return await fut
        except zmq.ZMQError as exc:
            raise _closed(exc) from exc
        finally:
            self._reads.discard(fut)

    def fail_reads(self) -> None:
        fail_all(self._reads, closed_error)

    def close(self) -> None:
        self._unwatch()  # before the socket (and its FD) goes
        self._sockets.close(self.pull)
        self.pull = None
