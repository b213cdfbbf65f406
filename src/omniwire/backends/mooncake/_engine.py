"""mooncake's raw engine calls, behind the :class:`Engine` seam.

:class:`Engine` is everything the backend asks of the Mooncake Transfer Engine.
:class:`TransferEngine` implements it with ``mooncake.engine``; a test (or an
application with its own engine) passes another object with the same methods as
``MooncakeBackend(ctx, engine=...)`` or ``backend_options={"mooncake": {"engine": ...}}``.

The engine's calls return int codes and never raise: :class:`TransferEngine`
checks every code, once, here. Its calls block: run them in worker threads.

A process runs one engine per ``(host, protocol, device_name)``, shared by its
mooncake backends and kept until the process exits: stopping an engine holds the
GIL for about a second (its handshake listener polls once a second), which would
freeze every thread of the process.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import importlib
import os
import socket
import struct
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from ..._native import engine_stderr
from ...errors import BackendError
from ..support import TransferTimeoutError, poll_until

__all__ = [
    "Engine",
    "Reads",
    "TransferEngine",
    "WritingEngine",
    "import_error",
    "read",
    "shared_engine",
    "slice_for_mtu",
    "submit",
    "tcp_slice_size",
]


class Engine(Protocol):
    """The raw calls of a started transfer engine (blocking; every failure is a
    :class:`~omniwire.errors.BackendError`)."""

    #: ``host:rpc_port``: how peers name this engine.
    session: str

    def register(self, addr: int, length: int) -> None:
        """Let peers read ``[addr, addr + length)`` of this process."""

    def unregister(self, addr: int) -> None:
        """Undo :meth:`register` of the region starting at ``addr``."""

    def submit_read(self, session: str, local: int, remote: int, length: int) -> int:
        """Start reading ``length`` bytes at ``remote`` of ``session`` into ``local``;
        returns a batch id for :meth:`status`."""

    def status(self, batch: int) -> int:
        """1: done (the batch is freed), 0: in progress, -2: timed out in the engine,
        other negative: failed."""


class WritingEngine(Engine, Protocol):
    """An engine that also writes into a peer's memory (what landings need, see the
    package docstring); an :class:`Engine` without ``submit_write`` only reads."""

    def submit_write(self, session: str, local: int, remote: int, length: int) -> int:
        """Start writing ``length`` bytes at ``local`` to ``remote`` of ``session``;
        returns a batch id for :meth:`status`."""


@functools.cache
def import_error() -> str | None:
    """Why ``mooncake.engine`` cannot be imported here, or None (cached)."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    try:
        importlib.import_module("mooncake.engine")
    except (ImportError, OSError) as exc:
        return f"cannot import mooncake.engine: {exc}"
    return None


#: ``MC_TCP_SLICE_SIZE`` as the user set it (None: ours to choose), read at import.
_USER_SLICE = os.environ.get("MC_TCP_SLICE_SIZE")
#: The TCP transport's own slice: 64 KiB.
_ENGINE_SLICE = 64 << 10
_SIOCGIFADDR = 0x8915


def _interface_mtu(host: str) -> int | None:
    """The MTU of the local interface that holds IPv4 address ``host`` (Linux), or
    None (not an address of ours, not IPv4, no such information)."""
    try:
        packed = socket.inet_aton(host)
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for name in names:
            try:
                req = struct.pack("256s", name.encode()[:15])
                addr = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, req)[20:24]
            except OSError:
                continue  # no IPv4 address
            if addr == packed:
                with open(f"/sys/class/net/{name}/mtu") as f:
                    return int(f.read())
    return None


def tcp_slice_size(host: str) -> int | None:
    """The slice the TCP transport should cut transfers into when it serves them from
    ``host``: the largest whole number of TCP segments (the MSS of the interface's
    MTU, with TCP timestamps as Linux sends them by default) in the engine's 64 KiB;
    None to keep the engine's own (not an Ethernet interface of ours). A path with a
    smaller MTU than the interface's still stalls; ``MC_TCP_SLICE_SIZE`` set by the
    user is kept.

    Why: the transport writes 64 KiB slices, and at an MTU of 1500 each slice ends in
    a short segment, which the kernel holds back (Nagle) until the reader's delayed
    ACK comes. Between two namespace hosts (MTU 1500), one 1 MiB read in ten took
    about 60 ms instead of 3; with slices of 45 whole segments none took over 6 ms,
    our 1 MiB one-way went from 100–170 to 500–590 MB/s (mean of 300; streamed
    165–226 → 617–707 MB/s), and the bare engine's from 0.65–0.76 to 1.7 GB/s."""
    mtu = _interface_mtu(host)
    if mtu is None:
        return None
    try:
        with open("/proc/sys/net/ipv4/tcp_timestamps") as f:
            timestamps = f.read().strip() != "0"
    except OSError:
        timestamps = True
    return slice_for_mtu(mtu, timestamps)


def slice_for_mtu(mtu: int, timestamps: bool = True) -> int | None:
    """:func:`tcp_slice_size` for an interface of ``mtu`` bytes: whole segments of its
    IPv4 MSS in 64 KiB; None outside Ethernet's MTUs (576–9216, jumbo frames
    included: loopback's 64 KiB MTU does not set its segments, and it does not stall)."""
    if not 576 <= mtu <= 9216:
        return None
    mss = mtu - 40 - (12 if timestamps else 0)  # IPv4 and TCP headers, the timestamp option
    return (_ENGINE_SLICE // mss) * mss


class TransferEngine:
    """A started ``mooncake.engine.TransferEngine`` (``P2PHANDSHAKE``, no metadata
    server) with checked calls.

    Raises:
        BackendError: it cannot be loaded or started.
    """

    def __init__(self, host: str, protocol: str, device_name: str = "") -> None:
        os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
        try:
            engine = importlib.import_module("mooncake.engine").TransferEngine()
        except (ImportError, OSError) as exc:
            raise BackendError(f"mooncake: cannot load the transfer engine: {exc}") from exc
        if protocol == "tcp" and _USER_SLICE is None:
            slice_size = tcp_slice_size(host)
            if slice_size is not None:  # read by the transport when it starts
                os.environ["MC_TCP_SLICE_SIZE"] = str(slice_size)
        with engine_stderr("mooncake") as native:  # its glog lines go to omniwire.native
            rc = engine.initialize(host, "P2PHANDSHAKE", protocol, device_name)
        if rc != 0:
            said = f" ({native.text()})" if native.lines else ""
            raise BackendError(
                f"mooncake: TransferEngine.initialize({host!r}, 'P2PHANDSHAKE', {protocol!r}, "
                f"{device_name!r}) failed with code {rc}{said}"
            )
        self._te: Any = engine
        self.session = f"{host}:{engine.get_rpc_port()}"

    def register(self, addr: int, length: int) -> None:
        _check(self._te.register_memory(addr, length), f"register_memory(0x{addr:x}, {length})")

    def unregister(self, addr: int) -> None:
        _check(self._te.unregister_memory(addr), f"unregister_memory(0x{addr:x})")

    def submit_read(self, session: str, local: int, remote: int, length: int) -> int:
        batch = int(self._te.batch_transfer_async_read(session, [local], [remote], [length]))
        return _submitted(batch, f"read of {length} bytes at 0x{remote:x} from", session)

    def submit_write(self, session: str, local: int, remote: int, length: int) -> int:
        batch = int(self._te.batch_transfer_async_write(session, [local], [remote], [length]))
        return _submitted(batch, f"write of {length} bytes to 0x{remote:x} of", session)

    def status(self, batch: int) -> int:
        return int(self._te.transfer_check_status(batch))


def _submitted(batch: int, what: str, session: str) -> int:
    if batch == 0 or batch >= 2**63:  # 0: submit failed; (uint64)-1: no such segment
        code = batch if batch < 2**63 else batch - 2**64
        raise BackendError(f"mooncake: cannot submit a {what} session {session} (code {code})")
    return batch


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise BackendError(f"mooncake: {what} failed with code {rc}")


class Reads:
    """Reads (or, with ``write``, writes) of one session: :meth:`submit` starts them
    (each call only queues work for the engine's threads), :meth:`done` checks them
    (from any one thread at a time), :meth:`check` raises what failed. One batch per
    transfer: the engine's status call checks one task."""

    def __init__(
        self,
        engine: Engine,
        session: str,
        reads: Sequence[tuple[int, int, int]],
        *,
        write: bool = False,
    ) -> None:
        self.engine = engine
        self.session = session
        self.reads = reads
        self.write = write
        self.pending: list[tuple[int, int, int]] = []
        self.failures: list[str] = []
        op = "write" if write else "read"
        self.op = op
        where = "to" if write else "from"
        self.what = f"mooncake: {op} of {sum(r[2] for r in reads)} bytes {where} session {session}"

    def submit(self) -> None:
        """Raises BackendError when the engine refuses one (those before it were
        submitted: wait for them before the memory is reused)."""
        start = self.engine.submit_read
        if self.write:
            start = self.engine.submit_write  # type: ignore[attr-defined]
        for local, remote, length in self.reads:
            batch = start(self.session, local, remote, length)
            self.pending.append((batch, remote, length))

    def done(self) -> bool:
        for item in list(self.pending):
            batch, remote, length = item
            rc = self.engine.status(batch)
            if rc == 0:
                continue
            self.pending.remove(item)
            if rc != 1:
                how = "timed out in the engine" if rc == -2 else "failed"
                self.failures.append(
                    f"{self.op} of {length} bytes at 0x{remote:x} {how} (code {rc})"
                )
        return not self.pending

    def check(self) -> None:
        """Raises BackendError if a read failed."""
        if self.failures:
            raise BackendError(f"mooncake: {self.failures[0]} from session {self.session}")


def submit(
    engine: Engine,
    session: str,
    reads: Sequence[tuple[int, int, int]],
    timeout: float,
    *,
    write: bool = False,
) -> Reads:
    """Start each ``(local, remote, length)`` read of ``session`` (or write, with
    ``write``; blocking: the TCP transport may connect to the peer first); check them
    with :meth:`Reads.done`.

    Raises:
        BackendError: the engine refused one; those submitted before it were waited
            for (nothing of them lands later).
        TransferTimeoutError: it refused one, and those before it did not finish
            within ``timeout`` (they may still land).
    """
    batch = Reads(engine, session, reads, write=write)
    try:
        batch.submit()
    except BackendError:
        if batch.pending:  # those already submitted may still land: wait for them first
            try:
                poll_until(batch.done, timeout=timeout, what=batch.what)
            except TransferTimeoutError:
                raise
            except BackendError:
                pass
        raise
    return batch


def read(
    engine: Engine,
    session: str,
    reads: Sequence[tuple[int, int, int]],
    timeout: float,
    cancelled: Callable[[], bool] | None = None,
    *,
    spin: bool = False,
    write: bool = False,
) -> None:
    """Read (or write, with ``write``) each ``(local, remote, length)`` of ``session``
    and wait for all of them (blocking).

    Raises:
        TransferTimeoutError: not all done within ``timeout`` (they may still land).
        BackendError: the engine refused or failed a read; the others were waited for.
    """
    batch = submit(engine, session, reads, timeout, write=write)
    poll_until(batch.done, timeout=timeout, what=batch.what, cancelled=cancelled, spin=spin)
    batch.check()


_engines: dict[tuple[str, str, str], TransferEngine] = {}
_engines_lock = threading.Lock()
_inherited: list[TransferEngine] = []  # engines of the parent of a fork: never touched again


def _forget_engines_after_fork() -> None:
    # Their threads did not survive the fork; destroying them would join ghosts.
    _inherited.extend(_engines.values())
    _engines.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_engines_after_fork)


def shared_engine(host: str, protocol: str, device_name: str) -> TransferEngine:
    """This process's engine for ``(host, protocol, device_name)``, started on first use.

    Blocking (run it in a thread).

    Raises:
        BackendError: the engine cannot start.
    """
    key = (host, protocol, device_name)
    with _engines_lock:
        engine = _engines.get(key)
        if engine is None:
            engine = _engines[key] = TransferEngine(host, protocol, device_name)
        return engine
