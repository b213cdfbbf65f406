"""Helpers shared by test_lifecycle, test_robustness and test_liveness: file
descriptors, this process's shm segments, ipc socket files, raw frames, and a
raw ZeroMQ peer that keeps its inbox drained."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import anyio
import msgspec
import torch

from omniwire import codec, packing, wire
from omniwire.delivery import Delivery
from omniwire.endpoint import Endpoint

from conftest import omniwire_segments
from test_hostile import Mallory, _still_serves

#: The prefix of a wire 1.x frame (magic, major 1, minor 0, reserved).
FRAME_PREFIX = b"OWIR\x01\x00\x00\x00"


def fds() -> int:
    """Open file descriptors of this process."""
    return len(os.listdir("/proc/self/fd"))


def segments_of(pid: int) -> set[str]:
    """omniwire segments in /dev/shm whose name carries ``pid``."""
    return {s for s in omniwire_segments() if s.startswith(f"omniwire-{pid}-")}


def own_segments() -> set[str]:
    return segments_of(os.getpid())


def socket_files(address: str) -> list[str]:
    """The socket files an endpoint bound at ``address`` owns: the PULL path and the
    PUB path beside it (``<path>.abort``). Empty for tcp."""
    if not address.startswith("ipc://"):
        return []
    path = address[len("ipc://") :]
    return [path, path + ".abort"]


def existing(paths: list[str]) -> list[str]:
    """Those of ``paths`` that exist."""
    return [p for p in paths if os.path.exists(p)]


def raw_frame(body: dict[str, Any]) -> bytes:
    """A frame whose msgpack body is written as is (no validation on our side)."""
    return FRAME_PREFIX + msgspec.msgpack.encode(body)


def body_of(frame: bytes) -> dict[str, Any] | None:
    """The msgpack body of a frame as a plain dict (None if it is not one). Reads
    message types this checkout's wire module may not know (refusal, goodbye)."""
    try:
        body = msgspec.msgpack.decode(frame[len(FRAME_PREFIX) :])
    except msgspec.DecodeError:
        return None
    return body if isinstance(body, dict) else None


def message_body(msg: wire.Message) -> dict[str, Any]:
    """A valid message as an editable dict (bytes stay bytes)."""
    body = msgspec.msgpack.decode(wire.encode(msg)[len(FRAME_PREFIX) :])
    assert isinstance(body, dict)
    return body


def inline_chunk_frame(
    shape: tuple[int, ...],
    *,
    from_stage: str = "mallory",
    to_stage: str = "victim",
    request_id: str = "evil",
) -> bytes:
    """An inline stream chunk of one float32 tensor whose declared shape is ``shape``
    (nbytes 0, no data): built from a valid chunk and edited in msgpack, because a
    validating TensorMeta refuses to build the overflowing ones."""
    enc = codec.dumps({"t": torch.zeros((1, 0))})
    layout = packing.plan(enc.tensors, enc.paths)
    msg = wire.DataReadyMessage(
        request_id=request_id,
        from_stage=from_stage,
        to_stage=to_stage,
        inline=wire.InlineStreamChunkRef(header=enc.header, tensors=layout.metas, data=b""),
    )
    body = message_body(msg)
    body["inline"]["tensors"][0]["shape"] = list(shape)
    body["inline"]["tensors"][0]["nbytes"] = 0
    return raw_frame(body)


class DrainedMallory(Mallory):
    """Mallory whose PULL is read in the background (:meth:`drain`), so the victim
    never blocks on frames to it; what arrived is in :attr:`inbox` as dicts."""

    def __init__(self, victim: str) -> None:
        super().__init__(victim)
        self.inbox: list[dict[str, Any]] = []

    async def drain(self) -> None:
        while True:
            body = body_of(await self.pull.recv())
            if body is not None:
                self.inbox.append(body)

    def refusals(self) -> list[dict[str, Any]]:
        return [b for b in self.inbox if b.get("type") == "refusal"]

    async def wait_for(self, pred: Callable[[dict[str, Any]], bool], timeout: float) -> Any:
        """The first frame in the inbox matching ``pred`` (TimeoutError after ``timeout``)."""
        try:
            with anyio.fail_after(timeout):
                while True:
                    for body in self.inbox:
                        if pred(body):
                            return body
                    await anyio.sleep(0.02)
        except TimeoutError:
            types = [b.get("type") for b in self.inbox]
            raise TimeoutError(
                f"mallory: no matching frame within {timeout:g} s (got: {types})"
            ) from None


async def next_delivery(
    ep: Endpoint, pred: Callable[[Delivery], bool], timeout: float
) -> tuple[Delivery, list[Delivery]]:
    """The first delivery matching ``pred`` and those skipped before it (released).

    Raises TimeoutError after ``timeout`` seconds.
    """
    skipped: list[Delivery] = []
    try:
        with anyio.fail_after(timeout):
            while True:
                d = await ep.receive()
                if pred(d):
                    return d, skipped
                d.release()
                skipped.append(d)
    except TimeoutError:
        seen = [(d.kind, d.request_id, d.from_stage) for d in skipped]
        raise TimeoutError(
            f"{ep.name}: no matching delivery within {timeout:g} s (other deliveries: {seen})"
        ) from None


async def wait_until(cond: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll ``cond`` until it holds; TimeoutError naming ``what`` after ``timeout``."""
    try:
        with anyio.fail_after(timeout):
            while not cond():
                await anyio.sleep(0.05)
    except TimeoutError:
        raise TimeoutError(f"not within {timeout:g} s: {what}") from None


def counter(ep: Endpoint, name: str) -> int:
    return ep.counters.get(name, 0)


async def still_serves(victim: Endpoint, friend: Endpoint, tag: str) -> None:
    """``test_hostile._still_serves``, failing with a message that says the victim went deaf."""
    try:
        await _still_serves(victim, friend, tag)
    except TimeoutError:
        raise AssertionError(
            f"{victim.name} no longer takes {friend.name}'s payload {tag!r} "
            f"(internal_errors={counter(victim, 'internal_errors')})"
        ) from None


async def clients_come_and_go(srv: Endpoint, n: int, remembered: int) -> None:
    """``n`` clients, each under a new name, send ``srv`` a request, get its reply and
    close; then wait until ``srv``'s peer table remembers only ``remembered`` of them
    (``_TOMBSTONES`` patched to that)."""
    from test_endpoint import addr

    for i in range(n):
        async with Endpoint(f"c{i}", address=addr(f"c{i}"), peers={"srv": srv.address}) as c:
            await c.wait_peer("srv", 10)
            await (await c.send("srv", {"i": i}, request_id=f"q{i}")).wait(10)
            d = await srv.receive(10)
            await (await d.reply({"ok": i})).wait(10)
            assert (await c.receive(10)).payload == {"ok": i}
    await wait_until(
        lambda: len(srv._peers.all()) <= remembered, 10, "the table to forget the gone peers"
    )
