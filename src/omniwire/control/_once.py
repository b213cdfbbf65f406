"""One frame to an address there is no peer for (a refusal): a transient PUSH
socket closed at once, rate-limited, with a cap on those lingering."""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from typing import Any

import zmq

from .._ratelimit import TokenBucket
from ..addresses import parse_address
from ..errors import AddressError
from ._sockets import Sockets

log = logging.getLogger("omniwire.control")

_SEND_ONCE_LINGER_MS = 200


class SendOnce:
    """:class:`ControlPlane`'s ``send_once``, and what it did in :attr:`counts`."""

    def __init__(self, sockets: Sockets, *, rate: float, burst: int, max_live: int) -> None:
        self._sockets = sockets
        self._bucket = TokenBucket(rate, burst)
        self._max_live = max_live
        self._lingering: deque[float] = deque()  # when each transient socket is gone
        self.counts: dict[str, int] = dict.fromkeys(
            ("sent", "rate_limited", "invalid", "failed"), 0
        )

    def send(self, address: str, frame: bytes) -> bool:
        try:
            addr = parse_address(address, what="refusal address")
        except AddressError:
            self.counts["invalid"] += 1
            return False
        ctx = self._sockets.ctx
        if self._sockets.state != "open" or ctx is None:
            self.counts["invalid"] += 1
            return False
        now = time.monotonic()
        lingering = self._lingering
        while lingering and lingering[0] <= now:
            lingering.popleft()
        if len(lingering) >= self._max_live or not self._bucket.take():
            self.counts["rate_limited"] += 1
            return False
        sock: zmq.Socket[Any] | None = None
        try:
            sock = zmq.Socket(ctx, zmq.PUSH)  # a plain socket: no event-loop state
            self._sockets.options(sock, server=False, ipv6=addr.is_ipv6)
            sock.setsockopt(zmq.LINGER, _SEND_ONCE_LINGER_MS)
            sock.setsockopt(zmq.SNDHWM, 1)
            sock.connect(str(addr))
            sock.send(frame, zmq.DONTWAIT)
        except zmq.ZMQError as exc:
            self.counts["failed"] += 1
            log.debug("send_once to %s failed: %s", address, exc)
            return False
        finally:
            if sock is not None:
                with contextlib.suppress(zmq.ZMQError):
                    sock.close()  # returns at once; libzmq lingers in the background
        lingering.append(now + _SEND_ONCE_LINGER_MS / 1000)
        self.counts["sent"] += 1
        return True
