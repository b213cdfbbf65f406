"""``example_tcp``: an omniwire data-plane backend that moves bytes over plain TCP.

It follows the guide ``docs/backends.md`` ("Write a backend") of the omniwire
repository: a :class:`~omniwire.backends.ByteBackend` whose handles own their
release, memory from omniwire's shared slot pool, errors mapped once.

Sender: each object's packed bytes stay in this process — in a slot of a pool
(:class:`omniwire.backends.pool.SlotPool` over one CPU buffer) or, when the pool
has no room, in a buffer of their own — and a small asyncio TCP server, started
in :meth:`TcpBackend.start` on the endpoint's host, serves byte ranges of them to
the endpoint they were announced to. Receiver: an import's ``fetch`` asks the
sender for a range over one connection per peer (reused across objects, one
request at a time under a lock) and reads the answer straight into the
destination buffer.

The frames are described in :mod:`omniwire_backend_example._protocol`. Nothing is
pickled: connection info and references are msgspec structures decoded with
typed decoders. The sender checks every request — who asks, which object, which
bytes — and answers a bad one with an ERROR frame, raised on the receiver as
:class:`~omniwire.errors.BackendError`.

Options (``backend_options={"example_tcp": {...}}``):

- ``pool_size``: bytes of the sender's pool (default 64 MiB; 0: a buffer per object);
- ``host``: the address the server binds (default: the endpoint's host);
- ``port``: the port it binds (default 0: any free port, advertised in the Hello);
- ``advertise_host``: the address receivers connect to (default: the bound
  address; for a wildcard bind, the host of the sender's control address);
- ``timeout``: seconds one fetch may take before it fails (default 60).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
import socket
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

import anyio
import torch
from omniwire.backends.base import (
    Availability,
    BackendContext,
    ByteBackend,
    Capabilities,
    Export,
    Import,
    Locality,
    PeerInfo,
    map_errors,
)
from omniwire.backends.pool import Lease, SlotPool
from omniwire.backends.support import check_range
from omniwire.errors import BackendClosedError, BackendError

from . import _protocol as proto

__all__ = ["TcpBackend"]

log = logging.getLogger("omniwire_backend_example")

_WILDCARDS = frozenset({"", "*", "0.0.0.0", "::"})
#: Answers up to this size go out in one send (header and bytes together).
_SMALL = 64 * 1024
_REQUESTS = frozenset({proto.HELLO, proto.READ})
_ANSWERS = frozenset({proto.OK, proto.ERROR})

PeerKey = tuple[str, int]


class _Object:
    """Sender side: one announced object and the memory that holds it."""

    __slots__ = ("buffer", "freed", "lease", "nbytes", "owner", "pins", "published")

    def __init__(
        self, lease: Lease[torch.Tensor], buffer: torch.Tensor, nbytes: int, owner: PeerKey
    ) -> None:
        self.lease = lease
        self.buffer = buffer
        self.nbytes = nbytes
        self.owner = owner  # the only endpoint that may read it
        self.published = 0  # bytes [0, published) are written
        self.pins = 0  # answers being sent from it right now
        self.freed = False


class _TcpExport(Export):
    """One object, served to its peer until the ACK."""

    def __init__(self, backend: TcpBackend, object_id: int, obj: _Object) -> None:
        super().__init__(backend, obj.nbytes, obj.buffer[: obj.nbytes])
        self.tcp = backend
        self.object_id = object_id
        self.obj = obj
        self._ref = proto.encode(proto.Ref(backend.token, object_id, obj.nbytes))

    @property
    def ref(self) -> bytes:
        return self._ref

    async def publish(self, lo: int, hi: int) -> None:
        """Bytes ``[lo, hi)`` may now be served.

        Raises:
            BackendError: the range leaves a gap after what was published before.
        """
        obj = self.obj
        if lo > obj.published:
            raise BackendError(
                f"publish of [{lo}, {hi}) leaves a gap after byte {obj.published} "
                f"of object {self.object_id}"
            )
        obj.published = max(obj.published, min(hi, obj.nbytes))

    def _release(self) -> None:
        self.tcp._forget(self.object_id)


class _TcpImport(Import):
    """One announced object, read from the sender range by range."""

    def __init__(
        self, backend: TcpBackend, peer: PeerInfo, nbytes: int, ref: proto.Ref, link: _Link
    ) -> None:
        super().__init__(backend, peer, nbytes)
        self.tcp = backend
        self.ref = ref
        self.link = link
        if nbytes == 0:  # an empty object is never fetched: give it its (empty) buffer now
            self.buffer = torch.empty(0, dtype=torch.uint8)

    async def fetch(self, lo: int, hi: int, dest: torch.Tensor | None = None) -> None:
        """Read bytes ``[lo, hi)`` from the sender into ``dest`` (or ``buffer``).

        Raises:
            BackendError: the sender refused the request (unknown object, bad range),
                broke the protocol, went away, or did not answer within ``timeout``.
        """
        if self.closed:
            raise BackendError("fetch() on a closed example_tcp object")
        check_range(lo, hi, self.nbytes, "example_tcp")
        if hi == lo:
            return
        if dest is None:
            if self.buffer is None:
                self.buffer = torch.empty(self.nbytes, dtype=torch.uint8)
            dest = self.buffer
        await self.tcp._fetch(self, lo, hi, dest)


class _Client:
    """Sender side: a receiver connected to our server (known after its HELLO)."""

    __slots__ = ("key",)

    def __init__(self) -> None:
        self.key: PeerKey | None = None


class _Link:
    """Receiver side: a sender we fetch from, and our connection to it."""

    __slots__ = ("dead", "host", "lock", "port", "sock", "token")

    def __init__(self, host: str, port: int, token: str) -> None:
        self.host = host
        self.port = port
        self.token = token
        self.sock: socket.socket | None = None
        self.lock = anyio.Lock()
        self.dead = False


def _cpu_buffer(nbytes: int) -> torch.Tensor:
    """Memory for the pool, or a buffer of its own for one object.

    Raises:
        BackendError: there is none.
    """
    with map_errors({RuntimeError: BackendError, MemoryError: BackendError}, "example_tcp"):
        return torch.empty(max(nbytes, 1), dtype=torch.uint8)


class _Refused(Exception):
    """The sender answered a READ with ERROR; the connection is still in step."""


def _int_option(options: Mapping[str, Any], key: str, default: int, lo: int, hi: int) -> int:
    value = options.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise BackendError(
            f"example_tcp option {key!r} must be an integer in [{lo}, {hi}], not {value!r}"
        )
    return value


def _nodelay(sock: socket.socket) -> None:
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


async def _recv_exact(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, view: memoryview, *, eof_ok: bool = False
) -> bool:
    """Fill ``view`` from ``sock``. Returns False if the peer closed before the first
    byte and ``eof_ok``; raises ConnectionError if it closed anywhere else."""
    got, n = 0, len(view)
    while got < n:
        k = await loop.sock_recv_into(sock, view[got:])
        if k == 0:
            if got == 0 and eof_ok:
                return False
            raise ConnectionError(f"connection closed after {got} of {n} bytes")
        got += k
    return True


async def _recv_header(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, expect: frozenset[int]
) -> tuple[int, int]:
    head = bytearray(proto.HEADER.size)
    await _recv_exact(loop, sock, memoryview(head))
    return proto.decode_header(head, expect=expect)


async def _recv_body(loop: asyncio.AbstractEventLoop, sock: socket.socket, length: int) -> bytes:
    body = bytearray(length)
    await _recv_exact(loop, sock, memoryview(body))
    return bytes(body)


class TcpBackend(ByteBackend):
    """Moves packed bytes over plain TCP; see the module docstring for options."""

    name: ClassVar[str] = "example_tcp"
    summary: ClassVar[str] = (
        "plain TCP: the receiver reads byte ranges from the sender's memory (example plugin)"
    )
    install_hint: ClassVar[str] = "pip install omniwire-backend-example"
    auto_start: ClassVar[Literal["always", "tcp", "never"]] = "tcp"
    capabilities: ClassVar[Capabilities] = Capabilities(
        devices=frozenset({"cpu"}),
        localities=frozenset({Locality.SAME_HOST, Locality.CROSS_HOST}),
        progressive=True,
        zero_copy=False,
        preference=10,
    )

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        opts = ctx.options
        self.pool_size = _int_option(opts, "pool_size", 64 << 20, 0, 1 << 40)
        self.bind_host = str(opts.get("host", ctx.host))
        self.port = _int_option(opts, "port", 0, 0, 65535)
        advertise = opts.get("advertise_host")
        if advertise is not None:
            self.advertise_host = str(advertise)
        else:
            self.advertise_host = "" if self.bind_host in _WILDCARDS else self.bind_host
        timeout = opts.get("timeout", 60.0)
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
            raise BackendError(f"example_tcp option 'timeout' must be > 0, not {timeout!r}")
        self.timeout = float(timeout)
        #: Names this server in references and HELLOs (a reused port is detected).
        self.token = secrets.token_hex(16)
        # sender
        self._ids = itertools.count(1)
        self._objects: dict[int, _Object] = {}
        self._pinned: set[_Object] = set()  # freed while an answer was being sent
        self._region: torch.Tensor | None = None  # the pool's memory, made on first use
        self.pool: SlotPool[torch.Tensor] = SlotPool(
            "example_tcp pool",
            create=_cpu_buffer,
            option="backend_options['example_tcp']['pool_size']",
        )
        self._listener: socket.socket | None = None
        self._bound_port = 0
        self._accept_task: asyncio.Task[None] | None = None
        self._served: dict[asyncio.Task[None], _Client] = {}
        # receiver
        self._links: dict[PeerKey, _Link] = {}
        self._closed = False
        self.bytes_served = 0
        self.bytes_fetched = 0

    @classmethod
    def availability(cls) -> Availability:
        if not hasattr(socket, "AF_INET"):
            return Availability.missing("this Python has no TCP sockets")
        return Availability.ok()

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        """Listen on ``host:port``.

        Raises:
            BackendClosedError: the backend is closed.
            BackendError: the address cannot be resolved or bound.
        """
        if self._closed:
            raise BackendClosedError("example_tcp backend is closed")
        if self._listener is not None:
            return
        loop = asyncio.get_running_loop()
        host = None if self.bind_host in _WILDCARDS else self.bind_host
        where = f"{self.bind_host or '*'}:{self.port}"
        try:
            infos = await loop.getaddrinfo(
                host, self.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )
            family, kind, protocol, _, addr = infos[0]
            sock = socket.socket(family, kind, protocol)
        except OSError as exc:
            raise BackendError(f"example_tcp cannot listen on {where}: {exc}") from exc
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(addr)
            sock.listen(128)
            sock.setblocking(False)
        except OSError as exc:
            sock.close()
            raise BackendError(f"example_tcp cannot listen on {where}: {exc}") from exc
        self._listener = sock
        self._bound_port = int(sock.getsockname()[1])
        self._accept_task = loop.create_task(
            self._accept_loop(sock), name=f"example_tcp accept {self._bound_port}"
        )

    @property
    def listen_port(self) -> int:
        """The port the server listens on (0 before :meth:`start`)."""
        return self._bound_port

    def hello(self) -> bytes:
        if not self._bound_port:
            return b""  # not started: peers cannot reach this backend
        return proto.encode(proto.HelloInfo(self.advertise_host, self._bound_port, self.token))

    async def connect(self, peer: PeerInfo) -> None:
        """Remember where ``peer``'s server is (the connection opens on the first fetch).

        Raises:
            BackendError: its Hello info is malformed.
        """
        if self._closed:
            raise BackendClosedError("example_tcp backend is closed")
        info = proto.decode_hello_info(peer.info)
        old = self._links.pop(peer.key, None)
        if old is not None:
            self._drop_link(old)
        self._links[peer.key] = _Link(info.host or peer.host, info.port, info.token)

    async def disconnect(self, peer: PeerInfo) -> None:
        link = self._links.pop(peer.key, None)
        if link is not None:
            self._drop_link(link)
        for task, client in list(self._served.items()):
            if client.key == peer.key:
                task.cancel()  # its connection closes as the task ends

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        tasks = [t for t in (self._accept_task, *self._served) if t is not None]
        for task in tasks:
            task.cancel()
        loop = asyncio.get_running_loop()
        mine = [t for t in tasks if t.get_loop() is loop]
        if mine:
            await asyncio.gather(*mine, return_exceptions=True)
        self._accept_task = None
        self._served.clear()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        for link in self._links.values():
            self._drop_link(link)
        self._links.clear()
        self._objects.clear()
        self._pinned.clear()
        await self.pool.aclose()
        self._region = None

    def detail(self) -> dict[str, int]:
        return {
            **self.pool.detail(),
            "pinned": len(self._pinned),
            "connections_in": len(self._served),
            "connections_out": sum(1 for link in self._links.values() if link.sock is not None),
            "bytes_served": self.bytes_served,
            "bytes_fetched": self.bytes_fetched,
        }

    # -- sender ------------------------------------------------------------------------

    async def export(self, peer: PeerInfo, nbytes: int, device: str) -> Export:
        """A slot of the pool (or a buffer of its own), served to ``peer`` only.

        Raises:
            BackendClosedError: the backend is closed.
            BackendError: no memory.
        """
        if self._closed:
            raise BackendClosedError("example_tcp backend is closed")
        if nbytes < 0:
            raise BackendError(f"cannot export {nbytes} bytes")
        if self._region is None and self.pool_size > 0:
            self._region = _cpu_buffer(self.pool_size)
            self.pool.attach(self.pool_size)
        lease = await self.pool.take(nbytes, purpose=f"to {peer.name!r}")
        if lease.buffer is not None:
            buffer = lease.buffer
        else:
            assert self._region is not None
            buffer = self._region[lease.offset : lease.offset + nbytes]
        object_id = next(self._ids)
        obj = self._objects[object_id] = _Object(lease, buffer, nbytes, peer.key)
        return _TcpExport(self, object_id, obj)

    def _forget(self, object_id: int) -> None:
        """The export was released: nobody may read the object any more."""
        obj = self._objects.pop(object_id, None)
        if obj is None:
            return
        obj.freed = True
        if obj.pins:
            self._pinned.add(obj)  # an answer is still being sent from it
        else:
            self._reuse(obj)

    def _reuse(self, obj: _Object) -> None:
        self._pinned.discard(obj)
        obj.buffer = torch.empty(0, dtype=torch.uint8)
        obj.lease.release()

    def _check_read(
        self, key: PeerKey, object_id: int, lo: int, hi: int
    ) -> tuple[_Object | None, str]:
        obj = self._objects.get(object_id)
        if obj is None:
            return None, f"object {object_id} is unknown here (never announced, or released)"
        if obj.owner != key:
            return None, f"object {object_id} was announced to {obj.owner[0]!r}, not {key[0]!r}"
        if hi > obj.nbytes:
            return None, f"range [{lo}, {hi}) is outside object {object_id} of {obj.nbytes} bytes"
        if hi > obj.published:
            return None, (
                f"bytes [{obj.published}, {hi}) of object {object_id} are not published yet"
            )
        return obj, ""

    async def _accept_loop(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(listener)
            except OSError as exc:  # e.g. out of file descriptors: do not spin
                log.warning("example_tcp: accept failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            conn.setblocking(False)
            _nodelay(conn)
            client = _Client()
            task = loop.create_task(self._serve(loop, conn, client))
            self._served[task] = client
            task.add_done_callback(self._forget_served)

    def _forget_served(self, task: asyncio.Task[None]) -> None:
        self._served.pop(task, None)

    async def _serve(
        self, loop: asyncio.AbstractEventLoop, conn: socket.socket, client: _Client
    ) -> None:
        """Answer one receiver's requests until it hangs up or breaks the protocol."""
        try:
            while True:
                head = bytearray(proto.HEADER.size)
                if not await _recv_exact(loop, conn, memoryview(head), eof_ok=True):
                    return  # the receiver closed the connection
                kind, length = proto.decode_header(head, expect=_REQUESTS)
                body = await _recv_body(loop, conn, length)
                if kind == proto.HELLO:
                    if client.key is not None:
                        raise proto.FrameError("a second HELLO on one connection")
                    greeting = proto.decode_greeting(body)
                    if greeting.token != self.token:
                        raise proto.FrameError(
                            f"this example_tcp server is {self.token}, not {greeting.token} "
                            "(its port was reused by another endpoint?)"
                        )
                    client.key = (greeting.endpoint, greeting.instance)
                    await loop.sock_sendall(conn, proto.header(proto.OK, 0))
                    continue
                if client.key is None:
                    raise proto.FrameError("READ before HELLO")
                object_id, lo, hi = proto.decode_read(body)
                obj, why = self._check_read(client.key, object_id, lo, hi)
                if obj is None:
                    log.debug("example_tcp: refused a READ from %s: %s", client.key[0], why)
                    await loop.sock_sendall(conn, proto.encode_error(why))
                else:
                    await self._send_range(loop, conn, obj, lo, hi)
        except proto.FrameError as exc:
            log.info("example_tcp: closing a connection that broke the protocol: %s", exc)
            with contextlib.suppress(OSError, asyncio.TimeoutError):
                await asyncio.wait_for(loop.sock_sendall(conn, proto.encode_error(str(exc))), 1.0)
        except OSError as exc:
            log.debug("example_tcp: connection lost: %s", exc)
        except Exception:
            log.exception("example_tcp: server connection failed")
        finally:
            conn.close()

    async def _send_range(
        self, loop: asyncio.AbstractEventLoop, conn: socket.socket, obj: _Object, lo: int, hi: int
    ) -> None:
        n = hi - lo
        obj.pins += 1  # a release now defers reusing the memory until the answer is out
        try:
            view = obj.buffer[lo:hi].numpy().data
            if n <= _SMALL:
                await loop.sock_sendall(conn, proto.header(proto.OK, n) + view.tobytes())
            else:
                await loop.sock_sendall(conn, proto.header(proto.OK, n))
                await loop.sock_sendall(conn, view)
            self.bytes_served += n
        finally:
            obj.pins -= 1
            if obj.freed and obj.pins == 0:
                self._reuse(obj)

    # -- receiver ----------------------------------------------------------------------

    async def import_(self, peer: PeerInfo, ref: bytes, nbytes: int) -> Import:
        """Validate a reference from ``peer``.

        Raises:
            BackendClosedError: the backend is closed.
            BackendError: the peer did not announce example_tcp, the reference is
                malformed, names another server's object, or has another size.
        """
        if self._closed:
            raise BackendClosedError("example_tcp backend is closed")
        link = self._links.get(peer.key)
        if link is None:
            raise BackendError(f"{peer.name!r} did not announce example_tcp in its Hello")
        r = proto.decode_ref(ref)
        if r.token != link.token:
            raise BackendError(
                f"example_tcp reference from {peer.name!r} names an object of server "
                f"{r.token[:16]}…, which is not {peer.name!r}'s"
            )
        if r.size != nbytes:
            raise BackendError(
                f"example_tcp reference from {peer.name!r} has size {r.size} != {nbytes}"
            )
        return _TcpImport(self, peer, nbytes, r, link)

    async def _fetch(self, imp: _TcpImport, lo: int, hi: int, dest: torch.Tensor) -> None:
        """Read bytes ``[lo, hi)`` of ``imp`` into ``dest`` — the one place where socket
        and protocol errors become BackendErrors."""
        window = dest[lo:hi]
        if window.device.type != "cpu" or window.dtype != torch.uint8 or not window.is_contiguous():
            raise BackendError("example_tcp fetches into contiguous CPU uint8 buffers only")
        view = window.numpy().data
        link = imp.link
        object_id = imp.ref.object_id
        peer = imp.peer.name
        async with link.lock:
            if link.dead:
                raise BackendError(f"example_tcp: {peer!r} is gone")
            in_step = False
            try:
                with anyio.fail_after(self.timeout):
                    await self._read(link, object_id, lo, hi, view)
                in_step = True
            except _Refused as exc:
                in_step = True
                raise BackendError(f"{peer!r} refused to serve object {object_id}: {exc}") from None
            except TimeoutError as exc:
                raise BackendError(
                    f"example_tcp: {peer!r} did not serve bytes [{lo}, {hi}) "
                    f"within {self.timeout:g} s ({exc or 'timed out'})"
                ) from None
            except OSError as exc:
                raise BackendError(f"example_tcp connection to {peer!r} failed: {exc}") from exc
            finally:
                if not in_step or link.dead:  # half a frame may be pending: start afresh
                    self._close_sock(link)
        self.bytes_fetched += hi - lo

    async def _read(self, link: _Link, object_id: int, lo: int, hi: int, view: memoryview) -> None:
        loop = asyncio.get_running_loop()
        sock = link.sock if link.sock is not None else await self._dial(loop, link)
        await loop.sock_sendall(sock, proto.encode_read(object_id, lo, hi))
        kind, length = await _recv_header(loop, sock, _ANSWERS)
        if kind == proto.ERROR:
            raise _Refused(proto.decode_error(await _recv_body(loop, sock, length)))
        if length != hi - lo:
            raise proto.FrameError(f"OK carries {length} bytes for a READ of {hi - lo}")
        await _recv_exact(loop, sock, view)

    async def _dial(self, loop: asyncio.AbstractEventLoop, link: _Link) -> socket.socket:
        infos = await loop.getaddrinfo(link.host, link.port, type=socket.SOCK_STREAM)
        error: OSError | None = None
        for family, socktype, protocol, _, addr in infos:
            sock = socket.socket(family, socktype, protocol)
            sock.setblocking(False)
            try:
                await loop.sock_connect(sock, addr)
            except OSError as exc:
                sock.close()
                error = exc
                continue
            except BaseException:
                sock.close()
                raise
            break
        else:
            raise ConnectionError(f"cannot connect to {link.host}:{link.port}: {error}")
        try:
            _nodelay(sock)
            body = proto.encode(proto.Greeting(link.token, self.ctx.endpoint, self.ctx.instance))
            await loop.sock_sendall(sock, proto.header(proto.HELLO, len(body)) + body)
            kind, length = await _recv_header(loop, sock, _ANSWERS)
            if kind == proto.ERROR:
                text = proto.decode_error(await _recv_body(loop, sock, length))
                raise BackendError(f"example_tcp server at {link.host}:{link.port} refused: {text}")
            if length:
                raise proto.FrameError(f"OK to HELLO carries {length} bytes")
        except BaseException:
            sock.close()
            raise
        link.sock = sock
        return sock

    def _drop_link(self, link: _Link) -> None:
        link.dead = True
        if not link.lock.locked():  # else the fetch holding it closes the socket
            self._close_sock(link)

    @staticmethod
    def _close_sock(link: _Link) -> None:
        if link.sock is not None:
            link.sock.close()
            link.sock = None
