"""The example_tcp request protocol: refusals are BackendErrors, never crashes, and
a connection that breaks the protocol is closed without harming the others."""

from __future__ import annotations

import os
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, suppress

import anyio
import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from omniwire.backends.base import BackendContext, Export, Locality, PeerInfo
from omniwire.errors import BackendClosedError, BackendError

from omniwire_backend_example import TcpBackend
from omniwire_backend_example import _protocol as proto

Pair = tuple[TcpBackend, TcpBackend, PeerInfo, PeerInfo]


def _peer(backend: TcpBackend) -> PeerInfo:
    """How the other side sees ``backend`` after its Hello."""
    ctx = backend.ctx
    return PeerInfo(
        ctx.endpoint, ctx.instance, os.getpid(), "h", "t", Locality.SAME_HOST, backend.hello()
    )


def _backend(name: str, **options: object) -> TcpBackend:
    return TcpBackend(BackendContext(name, secrets.randbits(63), options=options))


@asynccontextmanager
async def _pair(**options: object) -> AsyncIterator[Pair]:
    """A sender and a receiver that completed their Hellos with each other."""
    sender, receiver = _backend("sender", **options), _backend("receiver", **options)
    await sender.start()
    await receiver.start()
    try:
        to_receiver, to_sender = _peer(receiver), _peer(sender)
        await sender.connect(to_receiver)
        await receiver.connect(to_sender)
        yield sender, receiver, to_receiver, to_sender
    finally:
        await receiver.aclose()
        await sender.aclose()
    assert sender.stats().detail["connections_in"] == 0


async def _announce(sender: TcpBackend, to: PeerInfo, data: bytes) -> Export:
    out = await sender.export(to, len(data), "cpu")
    assert out.buffer is not None
    out.buffer.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    await out.publish(0, len(data))
    return out


def _run(fn: Callable[[], Awaitable[None]]) -> None:
    anyio.run(fn)


@pytest.mark.parametrize("pool_size", [64 << 20, 0], ids=["pool", "no-pool"])
def test_fetch_reads_ranges_and_reuses_one_connection(pool_size: int) -> None:
    async def run() -> None:
        async with _pair(pool_size=pool_size) as (sender, receiver, to_receiver, to_sender):
            data = os.urandom(300_000)
            out = await _announce(sender, to_receiver, data)
            imp = await receiver.import_(to_sender, out.ref, len(data))
            dest = torch.zeros(len(data), dtype=torch.uint8)
            for lo, hi in [(0, 10), (10, 200_000), (200_000, len(data))]:
                await imp.fetch(lo, hi, dest)
            assert bytes(dest.numpy()) == data
            await imp.fetch(5, 70_000)  # no dest: into imp.buffer
            assert imp.buffer is not None and bytes(imp.buffer[5:70_000].numpy()) == data[5:70_000]
            imp.close()
            imp.close()  # idempotent
            out.release()
            out.release()  # idempotent
            assert receiver.stats().detail["connections_out"] == 1
            assert sender.stats().idle and receiver.stats().idle
            assert sender.stats().detail["pool_bytes_in_use"] == 0
            assert sender.stats().detail["pool_dedicated_created"] == (0 if pool_size else 1)

    _run(run)


def test_refused_reads_are_backend_errors_and_keep_the_connection() -> None:
    async def run() -> None:
        async with _pair() as (sender, receiver, to_receiver, to_sender):
            out = await _announce(sender, to_receiver, b"x" * 100)
            imp = await receiver.import_(to_sender, out.ref, 100)
            # not published yet
            half = await sender.export(to_receiver, 100, "cpu")
            await half.publish(0, 50)
            imp_half = await receiver.import_(to_sender, half.ref, 100)
            await imp_half.fetch(0, 50)
            with pytest.raises(BackendError, match="not published yet"):
                await imp_half.fetch(50, 100)
            # a forged reference: the right server, an object it never announced
            forged = proto.encode(proto.Ref(sender.token, 10**6, 100))
            with pytest.raises(BackendError, match="unknown here"):
                await (await receiver.import_(to_sender, forged, 100)).fetch(0, 100)
            # bytes past the end of the real object
            object_id = proto.decode_ref(out.ref).object_id
            longer = proto.encode(proto.Ref(sender.token, object_id, 4096))
            with pytest.raises(BackendError, match="outside object"):
                await (await receiver.import_(to_sender, longer, 4096)).fetch(0, 4096)
            # released: the ACK came, the object is gone
            out.release()
            with pytest.raises(BackendError, match="unknown here"):
                await imp.fetch(0, 100)
            # the connection stayed in step through all of that
            ok = await _announce(sender, to_receiver, b"fine")
            imp_ok = await receiver.import_(to_sender, ok.ref, 4)
            await imp_ok.fetch(0, 4)
            assert imp_ok.buffer is not None and bytes(imp_ok.buffer.numpy()) == b"fine"
            assert receiver.stats().detail["connections_out"] == 1
            half.release()
            ok.release()

    _run(run)


def test_objects_announced_to_someone_else_are_refused() -> None:
    async def run() -> None:
        async with _pair() as (sender, receiver, _to_receiver, to_sender):
            other = _peer(_backend("other"))
            out = await _announce(sender, other, b"secret")
            imp = await receiver.import_(to_sender, out.ref, 6)
            with pytest.raises(BackendError, match="announced to 'other'"):
                await imp.fetch(0, 6)
            out.release()

    _run(run)


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda ref: msgspec.structs.replace(ref, token="ab" * 16), "not 'sender'"),
        (lambda ref: msgspec.structs.replace(ref, size=7), "size 7"),
    ],
    ids=["foreign-token", "wrong-size"],
)
def test_open_validates_the_reference(mutate: Callable[[proto.Ref], proto.Ref], match: str) -> None:
    async def run() -> None:
        async with _pair() as (sender, receiver, to_receiver, to_sender):
            out = await _announce(sender, to_receiver, b"abcdef")
            ref = proto.decode_ref(out.ref)
            with pytest.raises(BackendError, match=match):
                await receiver.import_(to_sender, proto.encode(mutate(ref)), 6)
            assert receiver.stats().idle
            out.release()

    _run(run)


def test_a_gone_sender_is_a_backend_error() -> None:
    async def run() -> None:
        async with _pair() as (sender, receiver, to_receiver, to_sender):
            out = await _announce(sender, to_receiver, b"abc")
            imp = await receiver.import_(to_sender, out.ref, 3)
            await imp.fetch(0, 1)
            await sender.aclose()  # its server and connections go away
            with pytest.raises(BackendError, match="example_tcp"):
                await imp.fetch(1, 3)
            await receiver.disconnect(to_sender)
            with pytest.raises(BackendError, match="gone"):
                await imp.fetch(1, 3)
            imp.close()

    _run(run)


class _Raw:
    """A hand-driven client connection to a server, for protocol violations."""

    def __init__(self, stream: anyio.abc.SocketStream) -> None:
        self.stream = stream
        self.buffer = b""

    async def _fill(self, n: int) -> None:
        while len(self.buffer) < n:
            self.buffer += await self.stream.receive()

    async def frame(self) -> tuple[int, bytes]:
        """The next answer frame (kind, body)."""
        with anyio.fail_after(10):
            await self._fill(proto.HEADER.size)
            kind, length = proto.decode_header(
                self.buffer[: proto.HEADER.size], expect=frozenset({proto.OK, proto.ERROR})
            )
            await self._fill(proto.HEADER.size + length)
        body = self.buffer[proto.HEADER.size : proto.HEADER.size + length]
        self.buffer = self.buffer[proto.HEADER.size + length :]
        return kind, body

    async def closed_by_server(self) -> bool:
        with anyio.fail_after(10):
            try:
                await self._fill(len(self.buffer) + 1)
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                return True
        return False


@asynccontextmanager
async def _raw(port: int) -> AsyncIterator[_Raw]:
    async with await anyio.connect_tcp("127.0.0.1", port) as stream:
        yield _Raw(stream)


def _greeting(token: str) -> bytes:
    body = proto.encode(proto.Greeting(token, "raw", 1))
    return proto.header(proto.HELLO, len(body)) + body


@pytest.mark.parametrize(
    ("frame", "match"),
    [
        (b"GARBAGE!" * 2, b"bad magic"),
        (proto.encode_read(1, 0, 1), b"READ before HELLO"),
        (proto.header(proto.OK, 0), b"unexpected frame kind OK"),
        (proto.header(proto.HELLO, 1 << 40), b"exceeds"),
        (proto.header(proto.HELLO, 3) + b"\xc1\xc1\xc1", b"malformed HELLO"),
    ],
    ids=["magic", "read-first", "wrong-kind", "huge", "bad-hello"],
)
def test_protocol_violations_close_only_that_connection(frame: bytes, match: bytes) -> None:
    async def run() -> None:
        async with _pair() as (sender, receiver, to_receiver, to_sender):
            async with _raw(sender.listen_port) as raw:
                await raw.stream.send(frame)
                kind, body = await raw.frame()
                assert kind == proto.ERROR and match in body
                assert await raw.closed_by_server()
            # the server still serves everyone else
            out = await _announce(sender, to_receiver, b"ok")
            imp = await receiver.import_(to_sender, out.ref, 2)
            await imp.fetch(0, 2)
            out.release()

    _run(run)


def test_a_hello_for_another_server_is_refused() -> None:
    async def run() -> None:
        async with _pair() as (sender, *_):
            async with _raw(sender.listen_port) as raw:
                await raw.stream.send(_greeting("cd" * 16))
                kind, body = await raw.frame()
                assert kind == proto.ERROR and b"its port was reused" in body
                assert await raw.closed_by_server()
            async with _raw(sender.listen_port) as raw:
                await raw.stream.send(_greeting(sender.token) + proto.encode_read(99, 0, 1))
                assert await raw.frame() == (proto.OK, b"")
                kind, body = await raw.frame()
                assert kind == proto.ERROR and b"unknown here" in body
                await raw.stream.send(proto.encode_read(98, 0, 1))  # still in step
                kind, body = await raw.frame()
                assert kind == proto.ERROR and b"object 98" in body

    _run(run)


def test_closed_backend_refuses_work_and_options_are_checked() -> None:
    async def run() -> None:
        b = _backend("closing")
        await b.start()
        await b.aclose()
        with pytest.raises(BackendClosedError):
            await b.start()
        with pytest.raises(BackendClosedError):
            await b.connect(_peer(b))

    _run(run)
    for bad in ({"pool_size": -1}, {"port": 70000}, {"timeout": 0}, {"port": "80"}):
        with pytest.raises(BackendError, match="option"):
            _backend("bad", **bad)


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=proto.HEADER.size, max_size=proto.HEADER.size))
def test_decoding_random_headers_only_raises_frame_error(data: bytes) -> None:
    with suppress(proto.FrameError):
        proto.decode_header(data, expect=frozenset({proto.HELLO, proto.READ}))


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64))
def test_decoding_random_references_only_raises_frame_error(data: bytes) -> None:
    for decode in (proto.decode_ref, proto.decode_hello_info, proto.decode_greeting):
        with suppress(proto.FrameError):
            decode(data)


def test_a_wildcard_server_is_reached_at_the_peer_host() -> None:
    async def run() -> None:
        async with _pair(host="0.0.0.0") as (sender, receiver, to_receiver, to_sender):
            assert proto.decode_hello_info(sender.hello()).host == ""
            out = await _announce(sender, to_receiver, b"everywhere")
            imp = await receiver.import_(to_sender, out.ref, 10)
            await imp.fetch(0, 10)  # to_sender.host is 127.0.0.1
            assert imp.buffer is not None and bytes(imp.buffer.numpy()) == b"everywhere"
            out.release()

    _run(run)
