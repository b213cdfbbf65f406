"""A mock transport for tests of the endpoint's byte path, in the spirit of httpcore's
mock network backend: in-process memory, and hooks that pause or fail any call
deterministically.

Register it in the test that uses it, run endpoints of this process over it, and
drive it with :class:`MockHooks`::

    hooks = MockHooks()
    with register_mock_backend() as name:  # "mock"
        gate = hooks.pause("publish", when=lambda call: call.lo > 0)  # a later piece
        a = Endpoint("a", backends=[name], routes={"b": name},
                     backend_options={name: {"hooks": hooks}}, progressive_chunk=1 << 20)
        ...
        send = tg.start_soon(a.send, "b", {"x": torch.ones(1 << 20)}, ...)
        call = await gate.wait()       # the second piece's publish is held here
        await b.aclose()               # lose the peer between the pieces
        gate.open()                    # and let the sender carry on

Every call the backends of this process make is recorded in ``hooks.calls``. The
memory lives in a table of this process: both endpoints must run here (any
locality may be declared to them — ``host_id=`` fakes another host).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import anyio
import msgspec
import torch

from .. import registry
from ..backends.base import (
    BackendContext,
    ByteBackend,
    Capabilities,
    Export,
    Import,
    Locality,
    PeerInfo,
    copy_range,
)
from ..backends.support import check_range, decode_blob
from ..errors import BackendClosedError, BackendError

__all__ = ["MockBackend", "MockCall", "MockGate", "MockHooks", "register_mock_backend"]

Op = Literal["export", "publish", "import", "fetch", "release", "close"]


@dataclass(frozen=True)
class MockCall:
    """One call of a mock backend: ``op`` by endpoint ``endpoint`` about object ``key``
    (``publish``/``fetch``: bytes ``[lo, hi)``)."""

    op: Op
    endpoint: str
    peer: str
    key: str
    nbytes: int
    lo: int = 0
    hi: int = 0


class MockGate:
    """A paused call: :meth:`wait` until one reaches it, then :meth:`open` to let it go."""

    def __init__(self) -> None:
        self.call: MockCall | None = None
        self._reached = anyio.Event()
        self._opened = anyio.Event()

    async def wait(self, timeout: float = 30.0) -> MockCall:
        """The call held here, once one arrives.

        Raises:
            TimeoutError: none within ``timeout`` seconds.
        """
        with anyio.fail_after(timeout):
            await self._reached.wait()
        assert self.call is not None
        return self.call

    def open(self) -> None:
        """Let the held call (and any later one this gate catches) continue."""
        self._opened.set()

    async def _hold(self, call: MockCall) -> None:
        self.call = call
        self._reached.set()
        await self._opened.wait()


@dataclass
class _Rule:
    op: Op
    when: Callable[[MockCall], bool] | None
    times: int
    gate: MockGate | None = None
    error: BaseException | None = None
    flip: int = -1

    def matches(self, call: MockCall) -> bool:
        return self.times != 0 and call.op == self.op and (self.when is None or self.when(call))


class MockHooks:
    """What the mock backends that share it do: every call recorded in :attr:`calls`;
    calls matching a rule paused (:meth:`pause`) or failed (:meth:`fail`). Rules are
    checked in the order they were added; each applies ``times`` times (-1: always)."""

    def __init__(self) -> None:
        self.calls: list[MockCall] = []
        self._rules: list[_Rule] = []
        self._flips: list[_Rule] = []

    def pause(
        self, op: Op, *, when: Callable[[MockCall], bool] | None = None, times: int = 1
    ) -> MockGate:
        """Hold the next matching call until the returned gate is opened."""
        gate = MockGate()
        self._rules.append(_Rule(op, when, times, gate=gate))
        return gate

    def fail(
        self,
        op: Op,
        error: BaseException | None = None,
        *,
        when: Callable[[MockCall], bool] | None = None,
        times: int = 1,
    ) -> None:
        """Make the next matching call raise ``error`` (default: a BackendError naming
        it). ``release``/``close`` cannot fail (handles release idempotently)."""
        self._rules.append(_Rule(op, when, times, error=error))

    def flip_bit(
        self, at: int = 0, *, when: Callable[[MockCall], bool] | None = None, times: int = 1
    ) -> None:
        """Make the next matching ``fetch`` that covers byte ``at`` of its object
        deliver that byte with its lowest bit flipped (a corrupting link); the
        sender's memory is left as it is."""
        self._flips.append(_Rule("fetch", when, times, flip=at))

    def _flip_of(self, call: MockCall) -> int | None:
        for rule in self._flips:
            if rule.matches(call) and call.lo <= rule.flip < call.hi:
                rule.times -= 1 if rule.times > 0 else 0
                return rule.flip
        return None

    def of(self, op: Op) -> list[MockCall]:
        """The recorded calls of one kind."""
        return [c for c in self.calls if c.op == op]

    async def _check(self, call: MockCall) -> None:
        self.calls.append(call)
        for rule in self._rules:
            if rule.matches(call):
                if rule.times > 0:
                    rule.times -= 1
                if rule.gate is not None:
                    await rule.gate._hold(call)
                if rule.error is not None or rule.gate is None:
                    raise rule.error or BackendError(f"mock: {call.op} failed as asked ({call})")
                return


class _Object:
    __slots__ = ("buffer", "owner", "published", "to")

    def __init__(self, buffer: torch.Tensor, owner: tuple[str, int], to: tuple[str, int]) -> None:
        self.buffer = buffer
        self.owner = owner
        self.to = to
        self.published = 0


_objects: dict[str, _Object] = {}
_lock = threading.Lock()
_ids = itertools.count(1)


class _Ref(msgspec.Struct, frozen=True):
    key: str
    nbytes: int


_ref_decoder = msgspec.msgpack.Decoder(_Ref)
_encode = msgspec.msgpack.Encoder().encode


class _MockExport(Export):
    def __init__(self, backend: MockBackend, key: str, peer: PeerInfo, obj: _Object) -> None:
        super().__init__(backend, obj.buffer.numel(), obj.buffer)
        self.mock = backend
        self.key = key
        self.peer = peer
        self.obj = obj
        self._ref = _encode(_Ref(key, obj.buffer.numel()))

    @property
    def ref(self) -> bytes:
        return self._ref

    async def publish(self, lo: int, hi: int) -> None:
        await self.mock._hit("publish", self.peer, self.key, self.nbytes, lo, hi)
        self.obj.published = max(self.obj.published, hi)

    def _release(self) -> None:
        self.mock.hooks.calls.append(
            MockCall("release", self.mock.ctx.endpoint, self.peer.name, self.key, self.nbytes)
        )
        with _lock:
            _objects.pop(self.key, None)


class _MockImport(Import):
    def __init__(self, backend: MockBackend, peer: PeerInfo, key: str, obj: _Object) -> None:
        super().__init__(backend, peer, obj.buffer.numel())
        self.mock = backend
        self.key = key
        self.obj: _Object | None = obj
        if self.nbytes == 0:
            self.buffer = torch.empty(0, dtype=torch.uint8)

    async def fetch(self, lo: int, hi: int, dest: torch.Tensor | None = None) -> None:
        check_range(lo, hi, self.nbytes, "mock")
        await self.mock._hit("fetch", self.peer, self.key, self.nbytes, lo, hi)
        obj = self.obj
        if obj is None or self.closed:
            raise BackendError("mock: fetch on a closed import")
        if hi > obj.published:
            raise BackendError(f"mock: bytes [{obj.published}, {hi}) are not published")
        self.buffer = obj.buffer  # zero copy: a view of the sender's memory
        flip = self.mock.hooks._flip_of(
            MockCall("fetch", self.mock.ctx.endpoint, self.peer.name, self.key, self.nbytes, lo, hi)
        )
        if flip is not None and dest is None:  # corrupt a copy, not the sender's memory
            self.buffer = obj.buffer.clone()
        if dest is not None:
            await copy_range(dest, obj.buffer, lo, hi)
        if flip is not None:
            target = dest if dest is not None else self.buffer
            target[flip] ^= 1

    def _close(self) -> None:
        self.obj = None
        self.mock.hooks.calls.append(
            MockCall("close", self.mock.ctx.endpoint, self.peer.name, self.key, self.nbytes)
        )


class MockBackend(ByteBackend):
    """In-process memory behind the byte-path seam, with :class:`MockHooks`.

    Options (``backend_options={name: {...}}``): ``hooks`` (a :class:`MockHooks`
    shared with the test; default: a fresh one, in :attr:`hooks`).
    """

    name: ClassVar[str] = "mock"
    summary: ClassVar[str] = "in-process memory for tests of the byte path (omniwire.testing)"
    install_hint: ClassVar[str] = "register it in the test: omniwire.testing.register_mock_backend"
    auto_start: ClassVar[Literal["always", "tcp", "never"]] = "never"
    capabilities: ClassVar[Capabilities] = Capabilities(
        devices=frozenset({"cpu"}),
        localities=frozenset(Locality),
        progressive=True,
        zero_copy=True,
        preference=-100,
    )

    def __init__(self, ctx: BackendContext, *, hooks: MockHooks | None = None) -> None:
        super().__init__(ctx)
        given = hooks if hooks is not None else ctx.options.get("hooks")
        self.hooks: MockHooks = given if isinstance(given, MockHooks) else MockHooks()
        self._peers: set[tuple[str, int]] = set()
        self._closed = False

    async def _hit(
        self, op: Op, peer: PeerInfo, key: str, nbytes: int, lo: int = 0, hi: int = 0
    ) -> None:
        if self._closed:
            raise BackendClosedError("mock backend is closed")
        await self.hooks._check(MockCall(op, self.ctx.endpoint, peer.name, key, nbytes, lo, hi))

    async def connect(self, peer: PeerInfo) -> None:
        self._peers.add(peer.key)

    async def disconnect(self, peer: PeerInfo) -> None:
        self._peers.discard(peer.key)

    async def aclose(self) -> None:
        self._closed = True

    def detail(self) -> dict[str, int]:
        me = (self.ctx.endpoint, self.ctx.instance)
        with _lock:
            return {"objects": sum(1 for o in _objects.values() if o.owner == me)}

    async def export(self, peer: PeerInfo, nbytes: int, device: str) -> Export:
        """A zeroed buffer in this process's table.

        Raises:
            BackendClosedError: closed. BackendError: a hook failed it.
        """
        key = f"{self.ctx.instance:x}:{next(_ids)}"
        await self._hit("export", peer, key, nbytes)
        obj = _Object(
            torch.zeros(nbytes, dtype=torch.uint8),
            (self.ctx.endpoint, self.ctx.instance),
            peer.key,
        )
        with _lock:
            _objects[key] = obj
        return _MockExport(self, key, peer, obj)

    async def import_(self, peer: PeerInfo, ref: bytes, nbytes: int) -> Import:
        """The object the reference names, if ``peer`` exported it to this endpoint.

        Raises:
            BackendClosedError: closed. BackendError: malformed, unknown, not for us,
            or a hook failed it.
        """
        if self._closed:
            raise BackendClosedError("mock backend is closed")
        r = decode_blob(_ref_decoder, ref, f"mock reference from {peer.name!r}")
        await self._hit("import", peer, r.key, nbytes)
        if peer.key not in self._peers:
            raise BackendError(f"{peer.name!r} did not announce mock in its Hello")
        with _lock:
            obj = _objects.get(r.key)
        me = (self.ctx.endpoint, self.ctx.instance)
        if obj is None or obj.owner != peer.key or obj.to != me:
            raise BackendError(f"mock object {r.key!r} of {peer.name!r} is not one for us")
        if r.nbytes != nbytes or obj.buffer.numel() != nbytes:
            raise BackendError(f"mock reference from {peer.name!r} has size {r.nbytes} != {nbytes}")
        return _MockImport(self, peer, r.key, obj)


@contextlib.contextmanager
def register_mock_backend(name: str = "mock", **capabilities: Any) -> Iterator[str]:
    """Register :class:`MockBackend` as ``name`` for the block (replacing any of that
    name), with ``capabilities`` changed (``two_sided=True``, say); yields the name.

    Raises:
        TypeError: an unknown capability.
    """
    caps = dataclasses.replace(MockBackend.capabilities, **capabilities)
    cls = type(f"MockBackend[{name}]", (MockBackend,), {"name": name, "capabilities": caps})
    registry.register_backend(name, cls, replace=True)
    try:
        yield name
    finally:
        registry.unregister_backend(name)
