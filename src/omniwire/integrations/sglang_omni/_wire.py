"""One stage's omniwire endpoint: started with the stage, matched to get_async by key.

sglang-omni's relays are pull-shaped: ``put_async`` returns metadata, sglang-omni
sends it in its own ``DataReady`` message, and the receiving stage calls
``get_async(metadata, dest)``. omniwire is push-shaped. The adapter pushes at
``put_async`` (``Endpoint.send`` to the receiving stage's endpoint, the object
tagged with a key) and puts the key in the metadata; the receiving stage's
endpoint runs one loop (``_pump``) that takes every delivery and files it under
its key until ``get_async`` asks for it, or hands it to a ``get_async`` already
waiting. Deliveries are zero-copy views of the sender's shm arena: the only copy
is into sglang-omni's destination tensor, and ``release()`` right after it is the
omniwire ACK that frees the sender's slot.

Bounds: ``arrived`` holds deliveries whose ``DataReady`` has not been read yet;
each holds one of the sender's credits (``max_inflight`` per peer), so it is
bounded by the senders' credits; one nobody asked for within ``UNCLAIMED_S``
(sglang-omni dropped its ``DataReady``: a parse error, a stage stopping) is released
with a warning, so a lost ``DataReady`` cannot pin a credit for good. ``waiting``
holds one future per ``get_async`` in progress; ``failed`` the last 4,096 aborted
or failed requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from ...delivery import Delivery
from ...endpoint import Endpoint
from ...errors import OmniwireError, PeerLostError, RequestAbortedError

__all__ = ["StageWire", "omniwire_address", "wire_for", "wires"]

log = logging.getLogger("omniwire.integrations.sglang_omni")

_WIRES: dict[str, StageWire] = {}

#: Seconds a delivery waits for its ``get_async`` before it is released unread.
UNCLAIMED_S = float(os.environ.get("OMNIWIRE_SGLANG_UNCLAIMED_S", "120"))


def wires() -> Mapping[str, StageWire]:
    """The running stage wires of this process, by relay engine id."""
    return _WIRES


def wire_for(engine_id: str) -> StageWire | None:
    return _WIRES.get(engine_id)


def omniwire_address(sglang_endpoint: str) -> str:
    """The omniwire address of a stage, derived from its sglang-omni control address.

    ``ipc:///p`` → ``ipc:///p.ow``; ``tcp://host:port`` → ``tcp://host:(port +
    OMNIWIRE_SGLANG_PORT_OFFSET)`` (default 1000). Every stage derives every other
    stage's address the same way, so peers are introduced at start with no exchange.
    """
    if sglang_endpoint.startswith("ipc://"):
        return sglang_endpoint + ".ow"
    if sglang_endpoint.startswith("tcp://"):
        parts = urlsplit(sglang_endpoint)
        offset = int(os.environ.get("OMNIWIRE_SGLANG_PORT_OFFSET", "1000"))
        if parts.port is None or parts.hostname is None:
            raise OmniwireError(f"cannot derive an omniwire address from {sglang_endpoint!r}")
        host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
        return f"tcp://{host}:{parts.port + offset}"
    raise OmniwireError(f"cannot derive an omniwire address from {sglang_endpoint!r}")


class StageWire:
    """A stage's endpoint and the table that matches deliveries to ``get_async``."""

    def __init__(self, endpoint: Endpoint, engine_id: str) -> None:
        self.ep = endpoint
        self.engine_id = engine_id
        self.waiting: dict[str, tuple[str, asyncio.Future[Delivery]]] = {}
        self.arrived: dict[str, Delivery] = {}
        self.failed: dict[str, BaseException] = {}  # request id -> why (bounded below)
        self._pump_task: asyncio.Task[None] | None = None
        self.closed = False

    @property
    def name(self) -> str:
        return self.ep.name

    async def start(self) -> None:
        await self.ep.start()
        self._pump_task = asyncio.get_running_loop().create_task(
            self._pump(), name=f"omniwire-sglang-{self.ep.name}"
        )
        _WIRES[self.engine_id] = self

    async def aclose(self) -> None:
        if self.closed:
            return
        self.closed = True
        _WIRES.pop(self.engine_id, None)
        err = OmniwireError(f"the omniwire endpoint of stage {self.ep.name!r} closed")
        for _, fut in self.waiting.values():
            if not fut.done():
                fut.set_exception(err)
        self.waiting.clear()
        for d in self.arrived.values():
            d.release()
        self.arrived.clear()
        if self._pump_task is not None:
            self._pump_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._pump_task
        await self.ep.aclose(reason="stage stopped")

    async def take(self, key: str, request_id: str, timeout: float) -> Delivery:
        """The delivery filed under ``key``, waiting up to ``timeout`` seconds for it.

        Raises:
            TimeoutError: it did not arrive in time.
            RequestAbortedError: its request was aborted meanwhile.
            PeerLostError: the sender went away with it in flight.
        """
        d = self.arrived.pop(key, None)
        if d is not None:
            return d
        why = self.failed.get(request_id)
        if why is not None:
            raise why
        fut: asyncio.Future[Delivery] = asyncio.get_running_loop().create_future()
        self.waiting[key] = (request_id, fut)
        try:
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError as exc:
            raise TimeoutError(
                f"omniwire object {key!r} of request {request_id!r} did not reach stage "
                f"{self.ep.name!r} within {timeout} s"
            ) from exc
        finally:
            self.waiting.pop(key, None)

    def fail_request(self, request_id: str, exc: BaseException) -> None:
        """Fail every ``get_async`` of ``request_id`` waiting here and drop what arrived."""
        self.failed[request_id] = exc
        while len(self.failed) > 4096:  # the most recent failures are the useful ones
            self.failed.pop(next(iter(self.failed)))
        for rid, fut in list(self.waiting.values()):
            if rid == request_id and not fut.done():
                fut.set_exception(exc)
        for key, d in list(self.arrived.items()):
            if d.request_id == request_id:
                del self.arrived[key]
                d.release()

    def _sweep(self, now: float) -> None:
        """Release the oldest deliveries nobody asked for within UNCLAIMED_S."""
        while self.arrived:
            key, oldest = next(iter(self.arrived.items()))
            if now - oldest.received_at < UNCLAIMED_S:
                return
            del self.arrived[key]
            log.warning(
                "stage %s: object %s of request %s from %s was never read; released",
                self.name,
                key,
                oldest.request_id,
                oldest.from_stage,
            )
            oldest.release()

    async def _pump(self) -> None:
        async for d in self.ep:
            if d.kind == "payload":
                key = (d.metadata or {}).get("k")
                if not isinstance(key, str):
                    log.warning(
                        "stage %s: an omniwire payload without a key from %s dropped",
                        self.name,
                        d.from_stage,
                    )
                    d.release()
                    continue
                entry = self.waiting.get(key)
                if entry is not None and not entry[1].done():
                    entry[1].set_result(d)
                else:
                    self.arrived[key] = d
                    self._sweep(d.received_at)
            elif d.kind == "aborted":
                self.fail_request(
                    d.request_id,
                    RequestAbortedError(
                        f"request {d.request_id!r} aborted by {d.from_stage!r}: {d.error or ''}"
                    ),
                )
            elif d.kind == "error":
                exc: BaseException = (
                    PeerLostError(f"stage {d.from_stage!r} went away: {d.error}")
                    if d.cause in ("peer_lost", "peer_closed")
                    else OmniwireError(f"stage {d.from_stage!r}: {d.error}")
                )
                self.fail_request(d.request_id, exc)
            else:  # stream chunks and ends: the adapter sends none
                d.release()


def endpoint_options(*, gpu: bool, remote: bool) -> dict[str, Any]:
    """Endpoint options for a stage: environment overrides, then sglang-omni-like defaults."""
    backends = os.environ.get("OMNIWIRE_SGLANG_BACKENDS")
    if backends:
        names = tuple(b.strip() for b in backends.split(",") if b.strip())
    else:
        names = ("local", "shm")
        if gpu:
            names += ("cuda_ipc",)
        if remote:
            names += ("mooncake",)
    arena = int(os.environ.get("OMNIWIRE_SGLANG_ARENA_MB", "256")) << 20
    return {
        "backends": names,
        "backend_options": {"shm": {"arena_size": arena}},
        "zero_copy": True,
        "max_inflight": int(os.environ.get("OMNIWIRE_SGLANG_MAX_INFLIGHT", "64")),
        "receive_buffer": 256,
    }
