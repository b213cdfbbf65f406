"""The control plane: address checks, served addresses, socket accounting, bounded
sends to peers that take nothing, one-shot sends, and no raw ZMQError anywhere."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import pytest_asyncio
import zmq
import zmq.asyncio
from hypothesis import given
from hypothesis import strategies as st

from omniwire.addresses import IPC_PATH_MAX, Address, parse_address
from omniwire.control import ControlPlane, PeerEvent
from omniwire.errors import (
    AddressError,
    AddressInUseError,
    ConfigurationError,
    EndpointClosedError,
    EndpointNotStartedError,
    OmniwireError,
    PeerLostError,
    PeerUnresponsiveError,
)

# -- addresses -------------------------------------------------------------------------

ABORT = ".abort"

VALID = [
    ("ipc:///tmp/x", False, "ipc:///tmp/x", Address("ipc", path="/tmp/x")),
    ("ipc://relative/sock", False, "ipc://relative/sock", Address("ipc", path="relative/sock")),
    ("ipc://@abstract-name", True, "ipc://@abstract-name", Address("ipc", path="@abstract-name")),
    ("tcp://127.0.0.1:5555", False, "tcp://127.0.0.1:5555", Address("tcp", "", "127.0.0.1", 5555)),
    ("tcp://localhost:1", False, "tcp://localhost:1", Address("tcp", "", "localhost", 1)),
    (
        "tcp://node-7.example.org:65535",
        False,
        None,
        Address("tcp", "", "node-7.example.org", 65535),
    ),
    ("tcp://[::1]:5555", False, "tcp://[::1]:5555", Address("tcp", "", "::1", 5555)),
    ("tcp://[0:0:0:0:0:0:0:1]:80", False, "tcp://[::1]:80", Address("tcp", "", "::1", 80)),
    ("tcp://*:*", True, "tcp://*:*", Address("tcp", "", "*", 0)),
    ("tcp://127.0.0.1:0", True, "tcp://127.0.0.1:*", Address("tcp", "", "127.0.0.1", 0)),
    ("tcp://0.0.0.0:5555", True, "tcp://0.0.0.0:5555", Address("tcp", "", "0.0.0.0", 5555)),
    ("tcp://[::]:*", True, "tcp://[::]:*", Address("tcp", "", "::", 0)),
]


@pytest.mark.parametrize(
    ("text", "bind", "canonical", "expected"), VALID, ids=[v[0] for v in VALID]
)
def test_parse_accepts_what_zeromq_can_use(
    text: str, bind: bool, canonical: str | None, expected: Address
) -> None:
    addr = parse_address(text, bind=bind)
    assert addr == expected
    assert str(addr) == (canonical or text)
    assert parse_address(str(addr), bind=bind) == addr  # canonical is a fixed point


def _path(n: int) -> str:
    """An absolute path of exactly ``n`` bytes."""
    return "/tmp/" + "p" * (n - 5)


INVALID = [
    ("tpc://host:5555", False, "scheme 'tpc'"),
    ("TCP://host:5555", False, "scheme 'TCP'"),
    ("inproc://x", False, "scheme 'inproc'"),
    ("ipc:/x", False, "two slashes"),
    ("tcp:/host:1", False, "two slashes"),
    ("not-an-endpoint", False, "no scheme"),
    ("", False, "no scheme"),
    ("ipc://", False, "path is empty"),
    ("ipc://*", True, "random path"),
    ("ipc:///tmp/dir/", True, "directory"),
    ("ipc://" + _path(IPC_PATH_MAX + 1), False, f"at most {IPC_PATH_MAX}"),
    ("ipc://" + _path(IPC_PATH_MAX - 5), True, f"at most {IPC_PATH_MAX - 6}"),
    ("tcp://", False, "port is missing"),
    ("tcp://127.0.0.1", False, "port is missing"),
    ("tcp://127.0.0.1:", False, "from 1 to 65535"),
    ("tcp://:5555", False, "host is missing"),
    ("tcp://127.0.0.1:0", False, "cannot be '*' or 0"),
    ("tcp://127.0.0.1:*", False, "cannot be '*' or 0"),
    ("tcp://127.0.0.1:65536", False, "from 1 to 65535"),
    ("tcp://127.0.0.1:70000", False, "from 1 to 65535"),
    ("tcp://127.0.0.1:-1", False, "from 1 to 65535"),
    ("tcp://127.0.0.1:1e3", False, "from 1 to 65535"),
    ("tcp://127.0.0.1:\uff15\uff15", False, "from 1 to 65535"),  # fullwidth digits
    ("tcp://::1:5555", False, "in brackets"),
    ("tcp://[::1:5555", False, "[addr]:port"),
    ("tcp://[::1]5555", False, "[addr]:port"),
    ("tcp://[nonsense]:1", False, "not an IPv6"),
    ("tcp://999.1.1.1:1", False, "not an IPv4"),
    ("tcp://a;b:1", False, "not a host name"),
    ("tcp://-bad-:1", False, "not a host name"),
    ("tcp://" + "a" * 254 + ":1", False, "not a host name"),
    ("tcp://*:5555", False, "every interface"),
    ("tcp://0.0.0.0:5555", False, "every interface"),
    ("tcp://[::]:5555", False, "every interface"),
    ("tcp://127.0.0.1:5555\n", False, "control"),
    ("ipc:///tmp/a\x00b", False, "control"),
    ("ipc:///tmp/\u202eevil", False, "control"),  # right-to-left override
    ("ipc:///tmp/" + "x" * 5000, False, "characters long"),
]


@pytest.mark.parametrize(("text", "bind", "why"), INVALID, ids=[repr(v[0])[:40] for v in INVALID])
def test_parse_refuses_with_an_error_naming_what_the_value_and_why(
    text: str, bind: bool, why: str
) -> None:
    with pytest.raises(AddressError) as info:
        parse_address(text, what="peer 'b' address", bind=bind)
    message = str(info.value)
    assert isinstance(info.value, ConfigurationError)
    assert message.startswith("peer 'b' address ")
    assert why in message
    assert repr(text[:30])[:-1] in message  # the value, quoted (long ones truncated)
    assert len(message) < 400


def test_parse_refuses_a_non_string() -> None:
    with pytest.raises(AddressError, match="must be a string"):
        parse_address(5555)  # type: ignore[arg-type]


def test_the_ipc_limits_are_libzmqs() -> None:
    """A bound path leaves room for '.abort': both bind; one byte more does not."""
    assert IPC_PATH_MAX == 107
    ctx = zmq.Context()
    base = tempfile.mkdtemp(prefix="ow-")
    try:
        longest = base + "/" + "s" * (IPC_PATH_MAX - len(ABORT) - len(base) - 1)
        assert parse_address("ipc://" + longest, bind=True).path == longest
        for path in (longest, longest + ABORT):
            sock = ctx.socket(zmq.PULL)
            sock.bind("ipc://" + path)
            sock.close(0)
        too_long = longest + ABORT + "x"
        with pytest.raises(AddressError):
            parse_address("ipc://" + too_long)
        sock = ctx.socket(zmq.PUSH)
        with pytest.raises(zmq.ZMQError):
            sock.connect("ipc://" + too_long)
        sock.close(0)
    finally:
        ctx.term()
        shutil.rmtree(base)


@given(st.text(max_size=80) | st.from_regex(r"\A(ipc|tcp)://[\[\]:*a-z0-9./@-]{0,40}\Z"))
def test_parse_any_text_gives_an_address_or_an_address_error(text: str) -> None:
    for bind in (False, True):
        try:
            addr = parse_address(text, bind=bind)
        except AddressError:
            continue
        assert parse_address(str(addr), bind=bind) == addr


# -- fixtures --------------------------------------------------------------------------


@pytest.fixture
def short_dir() -> Iterator[str]:
    """A directory with a short path (pytest's tmp_path can exceed the ipc limit)."""
    path = tempfile.mkdtemp(prefix="owc-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


class Raw:
    """Plain ZeroMQ sockets for the other side; each is kept until the test ends."""

    def __init__(self) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sockets: list[zmq.asyncio.Socket] = []

    def socket(self, kind: int) -> zmq.asyncio.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        self.sockets.append(sock)
        return sock

    def close(self) -> None:
        for sock in self.sockets:
            sock.close(0)
        self.ctx.term()


@pytest_asyncio.fixture
async def zctx() -> AsyncIterator[Raw]:
    raw = Raw()
    yield raw
    raw.close()


@pytest_asyncio.fixture
async def plane(short_dir: str) -> AsyncIterator[ControlPlane]:
    cp = ControlPlane(f"ipc://{short_dir}/me")
    await cp.start()
    yield cp
    cp.close()


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _exists(path: str) -> bool:
    return os.path.exists(path)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _python(code: str, *args: str) -> subprocess.Popen[bytes]:
    """A child Python that prints one line once its sockets are bound."""
    proc = subprocess.Popen(
        [sys.executable, "-c", code, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert proc.stdout is not None and proc.stdout.readline() == b"bound\n"
    return proc


def _free_tcp_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _recv(sock: zmq.asyncio.Socket, timeout: float = 20.0) -> bytes:
    with anyio.fail_after(timeout):
        return await sock.recv()  # type: ignore[no-any-return]


# -- start: served addresses, stale files, nothing left behind ---------------------------


def test_the_constructor_refuses_a_malformed_address_and_creates_nothing(short_dir: str) -> None:
    for bad in ("ipc:/x", "tpc://h:1", "ipc://" + short_dir + "/" + "x" * 120, "tcp://h:0x1"):
        with pytest.raises(AddressError, match="address"):
            ControlPlane(bad)
    assert os.listdir(short_dir) == []


@pytest.mark.asyncio
async def test_start_refuses_an_ipc_path_a_live_plane_serves_and_leaves_it_working(
    short_dir: str, zctx: Raw
) -> None:
    address = f"ipc://{short_dir}/busy"
    first = ControlPlane(address)
    await first.start()
    try:
        second = ControlPlane(address)
        with pytest.raises(AddressInUseError, match="busy"):
            await second.start()
        assert second.socket_count() == 0
        push = zctx.socket(zmq.PUSH)
        push.connect(address)
        await push.send(b"still mine")
        assert await _recv_plane(first) == b"still mine"  # ZeroMQ did not steal the path
    finally:
        first.close()
    assert os.listdir(short_dir) == []


async def _recv_plane(cp: ControlPlane, timeout: float = 20.0) -> bytes:
    with anyio.fail_after(timeout):
        return await cp.recv()


@pytest.mark.asyncio
async def test_start_refuses_an_ipc_path_another_process_serves(short_dir: str) -> None:
    path = f"{short_dir}/other"
    code = (
        "import sys, zmq; s = zmq.Context().socket(zmq.PULL); s.bind(sys.argv[1]);"
        "print('bound', flush=True); sys.stdin.read()"
    )
    proc = _python(code, f"ipc://{path}")
    try:
        cp = ControlPlane(f"ipc://{path}")
        with pytest.raises(AddressInUseError, match="live process"):
            await cp.start()
        assert _exists(path)  # its file is untouched
        assert not _exists(path + ".abort")
    finally:
        proc.communicate(b"", timeout=30)


@pytest.mark.asyncio
async def test_start_refuses_when_the_abort_sibling_is_served(short_dir: str, zctx: Raw) -> None:
    squatter = zctx.socket(zmq.PULL)
    squatter.bind(f"ipc://{short_dir}/me.abort")
    cp = ControlPlane(f"ipc://{short_dir}/me")
    with pytest.raises(AddressInUseError, match=r"me\.abort"):
        await cp.start()
    assert sorted(os.listdir(short_dir)) == ["me.abort"]  # no 'me' left behind
    squatter.close(0)


@pytest.mark.asyncio
async def test_a_stale_socket_file_is_replaced(short_dir: str, zctx: Raw) -> None:
    path = f"{short_dir}/stale"
    crashed = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    crashed.bind(path)  # a socket file whose process is gone: nobody listens
    crashed.close()
    assert _exists(path)
    cp = ControlPlane(f"ipc://{path}")
    await cp.start()
    try:
        push = zctx.socket(zmq.PUSH)
        push.connect(f"ipc://{path}")
        await push.send(b"hello")
        assert await _recv_plane(cp) == b"hello"
    finally:
        cp.close()
    assert not _exists(path)


@pytest.mark.asyncio
async def test_a_regular_file_at_the_path_is_not_deleted(short_dir: str) -> None:
    path = f"{short_dir}/data.txt"
    await anyio.Path(path).write_text("precious")
    cp = ControlPlane(f"ipc://{path}")
    with pytest.raises(AddressError, match="not a socket"):
        await cp.start()
    assert _read(path) == "precious"


@pytest.mark.asyncio
async def test_start_refuses_a_tcp_port_in_use_and_leaves_nothing() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cp = ControlPlane(f"tcp://127.0.0.1:{port}")
        with pytest.raises(AddressInUseError, match=str(port)):
            await cp.start()
        assert cp.socket_count() == 0
        with pytest.raises(EndpointClosedError):
            await cp.recv()
        cp.close()  # still idempotent


@pytest.mark.asyncio
async def test_an_unknown_interface_is_an_address_error() -> None:
    cp = ControlPlane("tcp://no-such-interface-xyz.invalid:*")
    with pytest.raises(AddressError, match="cannot bind"):
        await cp.start()
    assert cp.socket_count() == 0


@pytest.mark.asyncio
async def test_lifecycle_errors_are_omniwire_errors(short_dir: str) -> None:
    cp = ControlPlane(f"ipc://{short_dir}/life")
    with pytest.raises(EndpointNotStartedError, match="not started"):
        await cp.recv()
    with pytest.raises(EndpointNotStartedError):
        cp.connect("b", f"ipc://{short_dir}/b")
    await cp.start()
    with pytest.raises(OmniwireError, match="already started"):
        await cp.start()
    cp.close()
    cp.close()
    with pytest.raises(EndpointClosedError):
        await cp.send("b", b"x")
    with pytest.raises(EndpointClosedError):
        await cp.publish(b"x")
    with pytest.raises(EndpointClosedError):
        cp.subscribe("b", f"ipc://{short_dir}/b.abort")
    assert not cp.send_nowait("b", b"x")
    assert not cp.send_once(f"ipc://{short_dir}/b", b"x")
    assert os.listdir(short_dir) == []


@pytest.mark.asyncio
async def test_socket_files_are_removed_before_aclose_awaits_even_if_cancelled(
    short_dir: str,
) -> None:
    cp = ControlPlane(f"ipc://{short_dir}/gone")
    await cp.start()
    cp.connect("b", f"ipc://{short_dir}/b")
    await cp.send("b", b"queued, nobody takes it")  # something for the linger to wait on
    with anyio.CancelScope() as scope:
        scope.cancel()
        await cp.aclose()
    assert os.listdir(short_dir) == []
    assert cp.socket_count() == 0


@pytest.mark.asyncio
async def test_close_removes_only_its_own_socket_files(short_dir: str) -> None:
    path = f"{short_dir}/mine"
    cp = ControlPlane(f"ipc://{path}")
    await cp.start()
    os.unlink(path)  # someone else's socket now lives at this path
    newcomer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    newcomer.bind(path)
    try:
        cp.close()
        assert _exists(path)
        assert not _exists(path + ".abort")
    finally:
        newcomer.close()


@pytest.mark.asyncio
async def test_relative_ipc_paths_bind_and_are_removed(
    short_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(short_dir)
    cp = ControlPlane("ipc://sub/rel")
    await cp.start()
    assert cp.address == f"ipc://{short_dir}/sub/rel"  # as other processes must dial it
    assert cp.abort_address == f"ipc://{short_dir}/sub/rel.abort"
    monkeypatch.chdir("/")  # files are removed where they were made
    cp.close()
    assert os.listdir(os.path.join(short_dir, "sub")) == []


# -- peers: connect, disconnect, subscriptions, accounting ------------------------------


HOSTILE_PEER_ADDRESSES = [
    "not-an-endpoint",
    "tcp://",
    "tcp://*:5555",
    "tcp://127.0.0.1:0",
    "ipc://" + "/tmp/" + "y" * 200,
    "ipc:/x",
    "tpc://h:1",
    "inproc://x",
    "",
]


@pytest.mark.asyncio
@pytest.mark.parametrize("address", HOSTILE_PEER_ADDRESSES, ids=repr)
async def test_connect_refuses_a_hostile_address_and_creates_nothing(
    plane: ControlPlane, address: str
) -> None:
    before = plane.socket_count()
    with pytest.raises(AddressError, match="peer 'mallory'"):
        plane.connect("mallory", address)
    with pytest.raises(AddressError, match="peer 'mallory'"):
        plane.subscribe("mallory", address or "ipc:/x")
    assert plane.socket_count() == before
    assert not plane.has_peer("mallory")
    assert plane.subscribed() == {}


@pytest.mark.asyncio
async def test_a_flood_of_peers_released_returns_every_socket_and_fd(
    plane: ControlPlane, short_dir: str
) -> None:
    for i in range(5):  # warm up lazily created io-thread state
        plane.connect(f"warm{i}", f"ipc://{short_dir}/w{i}")
        plane.subscribe(f"warm{i}", f"ipc://{short_dir}/w{i}.abort")
        plane.disconnect(f"warm{i}")
    sockets, fds = plane.socket_count(), _open_fds()
    for i in range(300):
        plane.connect(f"p{i}", f"ipc://{short_dir}/p{i}")
        plane.subscribe(f"p{i}", f"ipc://{short_dir}/p{i}.abort")
    assert plane.socket_count() == sockets + 600  # a PUSH and its monitor each
    assert _open_fds() > fds + 300
    for i in range(300):
        plane.disconnect(f"p{i}")
        plane.disconnect(f"p{i}")  # idempotent
    assert plane.socket_count() == sockets
    assert plane.subscribed() == {}
    with anyio.fail_after(20):  # libzmq's reaper closes the fds in the background
        while _open_fds() > fds + 2:
            await anyio.sleep(0.02)


@pytest.mark.asyncio
async def test_events_end_when_the_peer_is_released(
    plane: ControlPlane, short_dir: str, zctx: Raw
) -> None:
    pull = zctx.socket(zmq.PULL)
    pull.bind(f"ipc://{short_dir}/b")
    plane.connect("b", f"ipc://{short_dir}/b")
    seen: list[PeerEvent] = []

    async def watch() -> None:
        async for event in plane.events("b"):
            seen.append(event)

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch)
            while PeerEvent.UP not in seen:
                await anyio.sleep(0.01)
            plane.disconnect("b")  # watch() returns: no CancelledError, no ZMQError
    assert seen == [PeerEvent.UP]


@pytest.mark.asyncio
async def test_subscriptions_are_counted_per_address(
    plane: ControlPlane, short_dir: str, zctx: Raw
) -> None:
    pub = zctx.socket(zmq.PUB)
    shared = f"ipc://{short_dir}/shared.abort"
    pub.bind(shared)
    plane.subscribe("a", shared)
    plane.subscribe("b", shared)
    plane.subscribe("b", shared)  # the same again: no change
    assert plane.subscribed() == {shared: 2}
    with anyio.fail_after(20):  # a PUB drops until the subscription reaches it
        while True:
            await pub.send(b"abort r1")
            with anyio.move_on_after(0.1):
                assert await plane.recv_abort() == b"abort r1"
                break
    plane.unsubscribe("a")
    assert plane.subscribed() == {shared: 1}
    plane.subscribe("b", f"ipc://{short_dir}/moved.abort")  # b moves elsewhere
    assert plane.subscribed() == {f"ipc://{short_dir}/moved.abort": 1}
    plane.disconnect("b")
    plane.unsubscribe("b")
    assert plane.subscribed() == {}


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.asyncio
@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback on this host")
async def test_ipv6_peers_are_reached(plane: ControlPlane, zctx: Raw) -> None:
    pull = zctx.socket(zmq.PULL)
    pull.setsockopt(zmq.IPV6, 1)
    pull.bind("tcp://[::1]:*")
    address = pull.getsockopt_string(zmq.LAST_ENDPOINT)
    plane.connect("six", address)
    await plane.send("six", b"over ipv6")
    assert await _recv(pull) == b"over ipv6"  # ZeroMQ drops it silently without IPV6
    pub = zctx.socket(zmq.PUB)
    pub.setsockopt(zmq.IPV6, 1)
    pub.bind("tcp://[::1]:*")
    plane.subscribe("six", pub.getsockopt_string(zmq.LAST_ENDPOINT))
    with anyio.fail_after(20):
        while True:
            await pub.send(b"abort over ipv6")
            with anyio.move_on_after(0.1):
                assert await plane.recv_abort() == b"abort over ipv6"
                break


@pytest.mark.asyncio
async def test_tcp_binds_report_the_real_port_and_the_abort_port() -> None:
    cp = ControlPlane("tcp://127.0.0.1:*")
    await cp.start()
    try:
        bound = parse_address(cp.address)
        abort = parse_address(cp.abort_address)
        assert bound.host == abort.host == "127.0.0.1"
        assert bound.port and abort.port and bound.port != abort.port
    finally:
        cp.close()


# -- sends to a peer that takes nothing ------------------------------------------------

FRAME = bytes(65536)  # zero-copy in pyzmq: a thousand queued frames cost no memory


async def _fill(plane: ControlPlane, peer: str) -> int:
    """Queue frames until ZeroMQ would wait; returns how many."""
    sent = 0
    with anyio.fail_after(60):
        while plane.send_nowait(peer, FRAME):
            sent += 1
            if sent % 256 == 0:
                await anyio.lowlevel.checkpoint()  # let the io thread move what it can
    return sent


@pytest_asyncio.fixture
async def deaf(short_dir: str, zctx: Raw) -> zmq.asyncio.Socket:
    """A bound PULL socket that takes one message into its queue and reads nothing."""
    pull = zctx.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVHWM, 1)
    pull.setsockopt(zmq.RCVBUF, 4096)
    pull.bind(f"ipc://{short_dir}/deaf")
    return pull


@pytest.mark.asyncio
async def test_a_blocked_peer_shows_in_blocked_since_and_clears_when_it_reads(
    plane: ControlPlane, short_dir: str, deaf: zmq.asyncio.Socket
) -> None:
    plane.connect("deaf", f"ipc://{short_dir}/deaf")
    assert await _fill(plane, "deaf") > 0
    assert plane.blocked_since("deaf") is None  # nothing waits yet
    before = time.monotonic()
    async with anyio.create_task_group() as tg:
        tg.start_soon(plane.send, "deaf", b"the waiting one")
        with anyio.fail_after(20):
            while plane.blocked_since("deaf") is None:
                await anyio.sleep(0.01)
        since = plane.blocked_since("deaf")
        assert since is not None and since >= before
        with pytest.raises(PeerUnresponsiveError, match=r"'deaf' took no frame for 0\.2 s"):
            await plane.send("deaf", b"behind it", timeout=0.2)
        assert plane.blocked_since("deaf") == since  # no progress: still the same wait
        with anyio.fail_after(60):
            while True:  # the peer wakes up and reads everything
                if await deaf.recv() == b"the waiting one":
                    break
    assert plane.blocked_since("deaf") is None
    assert plane.send_nowait("deaf", b"flows again")


@pytest.mark.asyncio
async def test_waiters_fail_with_typed_errors_when_released(
    plane: ControlPlane, short_dir: str, deaf: zmq.asyncio.Socket
) -> None:
    plane.connect("deaf", f"ipc://{short_dir}/deaf")
    await _fill(plane, "deaf")
    loop = asyncio.get_running_loop()
    send = loop.create_task(plane.send("deaf", b"never taken"))
    recv = loop.create_task(plane.recv())
    with anyio.fail_after(20):
        while plane.blocked_since("deaf") is None:
            await anyio.sleep(0.01)
    plane.disconnect("deaf")
    with pytest.raises(PeerLostError, match="'deaf'"):
        await send  # not CancelledError, not ZMQError
    assert plane.blocked_since("deaf") is None
    with pytest.raises(KeyError):
        await plane.send("deaf", b"after release")
    plane.connect("deaf", f"ipc://{short_dir}/deaf")
    await _fill(plane, "deaf")
    send = loop.create_task(plane.send("deaf", b"never taken"))
    with anyio.fail_after(20):
        while plane.blocked_since("deaf") is None:
            await anyio.sleep(0.01)
    plane.close()
    with pytest.raises(EndpointClosedError):
        await send
    with pytest.raises(EndpointClosedError):
        await recv


@pytest.mark.asyncio
async def test_cancelling_a_waiting_send_unqueues_its_frame(
    plane: ControlPlane, short_dir: str, deaf: zmq.asyncio.Socket
) -> None:
    plane.connect("deaf", f"ipc://{short_dir}/deaf")
    await _fill(plane, "deaf")
    with anyio.move_on_after(0.2):
        await plane.send("deaf", b"cancelled")
    assert plane.blocked_since("deaf") is None
    received: list[bytes] = []

    async def read_all() -> None:
        while not received or received[-1] != b"last":
            received.append(await deaf.recv())

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            tg.start_soon(read_all)  # the peer wakes up
            await plane.send("deaf", b"last")
    assert received[-1] == b"last"
    assert b"cancelled" not in received


@pytest.mark.asyncio
async def test_a_sigstopped_receiver_blocks_sends_until_the_timeout(short_dir: str) -> None:
    """SIGSTOP the receiving process: the PUSH queue fills, ``blocked_since`` is set and
    a bounded send ends with PeerUnresponsiveError; after SIGCONT frames flow again."""
    address = f"ipc://{short_dir}/stopped"
    code = (
        "import sys, zmq; s = zmq.Context().socket(zmq.PULL); s.bind(sys.argv[1]);"
        "print('bound', flush=True)\nwhile s.recv() != b'last': pass\nprint('done', flush=True)"
    )
    proc = _python(code, address)
    assert proc.stdout is not None
    cp = ControlPlane(f"ipc://{short_dir}/me")
    await cp.start()
    try:
        cp.connect("r", address)
        os.kill(proc.pid, signal.SIGSTOP)
        await _fill(cp, "r")
        with pytest.raises(PeerUnresponsiveError, match="'r'"):
            await cp.send("r", FRAME, timeout=1.0)
        os.kill(proc.pid, signal.SIGCONT)
        with anyio.fail_after(60):
            await cp.send("r", b"last")
        assert cp.blocked_since("r") is None
        with anyio.fail_after(60):
            assert await anyio.to_thread.run_sync(proc.stdout.readline) == b"done\n"
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.communicate(timeout=30)
        cp.close()


# -- one-shot sends ---------------------------------------------------------------------


@pytest.mark.asyncio
async def test_send_once_delivers_and_keeps_no_socket(
    plane: ControlPlane, short_dir: str, zctx: Raw
) -> None:
    pull = zctx.socket(zmq.PULL)
    pull.bind(f"ipc://{short_dir}/stranger")
    before = plane.socket_count()
    assert plane.send_once(f"ipc://{short_dir}/stranger", b"refused: name_in_use")
    assert plane.socket_count() == before
    assert await _recv(pull) == b"refused: name_in_use"
    assert plane.send_once_counts["sent"] == 1


@pytest.mark.asyncio
@pytest.mark.parametrize("address", HOSTILE_PEER_ADDRESSES, ids=repr)
async def test_send_once_to_a_hostile_address_is_dropped_and_counted(
    plane: ControlPlane, address: str
) -> None:
    assert not plane.send_once(address, b"refusal")
    assert plane.send_once_counts == {"sent": 0, "rate_limited": 0, "invalid": 1, "failed": 0}


@pytest.mark.asyncio
async def test_send_once_is_rate_limited(short_dir: str) -> None:
    cp = ControlPlane(f"ipc://{short_dir}/me", send_once_rate=0, send_once_burst=3)
    await cp.start()
    try:
        results = [cp.send_once(f"ipc://{short_dir}/nobody{i}", b"r") for i in range(10)]
        assert results == [True] * 3 + [False] * 7
        assert cp.send_once_counts["rate_limited"] == 7
    finally:
        cp.close()  # returns: the transient sockets linger 200 ms at most


@pytest.mark.asyncio
async def test_send_once_caps_the_sockets_lingering_at_once(short_dir: str) -> None:
    cp = ControlPlane(f"ipc://{short_dir}/me", send_once_burst=100, send_once_max_live=2)
    await cp.start()
    try:
        start = time.monotonic()
        results = [cp.send_once(f"ipc://{short_dir}/nobody{i}", b"r") for i in range(10)]
        if time.monotonic() - start < 0.2:  # all within one linger period
            assert results == [True, True] + [False] * 8
        assert sum(results) < 10
        await anyio.sleep(0.3)  # the first ones are gone: room again
        assert cp.send_once(f"ipc://{short_dir}/later", b"r")
    finally:
        cp.close()


@pytest.mark.asyncio
async def test_send_once_does_not_wait_for_an_absent_peer(plane: ControlPlane) -> None:
    port = _free_tcp_port()  # nobody listens: the frame lingers 200 ms, then is dropped
    start = time.monotonic()
    for _ in range(5):
        assert plane.send_once(f"tcp://127.0.0.1:{port}", b"refusal")
    assert time.monotonic() - start < 5  # no connect, no linger is awaited here


# -- nothing raw escapes ----------------------------------------------------------------


@pytest.mark.asyncio
async def test_publish_and_recv_work_and_close_ends_a_waiting_recv(short_dir: str) -> None:
    a = ControlPlane(f"ipc://{short_dir}/a")
    b = ControlPlane(f"ipc://{short_dir}/b")
    await a.start()
    await b.start()
    try:
        b.subscribe("a", a.abort_address)
        a.connect("b", b.address)
        await a.send("b", b"frame")
        assert await _recv_plane(b) == b"frame"
        with anyio.fail_after(20):
            while True:
                await a.publish(b"abort")
                with anyio.move_on_after(0.1):
                    assert await b.recv_abort() == b"abort"
                    break
        waiting: list[Any] = []

        async def wait_abort() -> None:
            try:
                await b.recv_abort()
            except EndpointClosedError as exc:
                waiting.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(wait_abort)
            await anyio.sleep(0.05)
            b.close()
        assert len(waiting) == 1
    finally:
        a.close()
        b.close()
    assert os.listdir(short_dir) == []


_FD_EXHAUSTION = """
import asyncio, os, resource, sys
from omniwire.control import ControlPlane
from omniwire.errors import AddressError

async def main(d):
    cp = ControlPlane(f"ipc://{d}/me")
    await cp.start()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 30, hard))
    baseline = cp.socket_count()
    try:
        for i in range(1000):
            cp.connect(f"p{i}", f"ipc://{d}/p{i}")
    except AddressError as exc:
        assert "Too many open files" in str(exc), exc
        assert cp.socket_count() == baseline + 2 * len(cp.peers())  # the failed one: none
    else:
        raise AssertionError("1000 peers within 30 fds")
    for peer in cp.peers():
        cp.disconnect(peer)
    assert cp.socket_count() == baseline
    for _ in range(200):  # the reaper frees the fds in the background
        try:
            cp.connect("again", f"ipc://{d}/again")
            break
        except AddressError:
            await asyncio.sleep(0.05)
    assert cp.has_peer("again")
    await cp.aclose()
    print("ok", flush=True)

asyncio.run(main(sys.argv[1]))
"""


def test_running_out_of_file_descriptors_is_an_address_error_and_recovers(short_dir: str) -> None:
    out = subprocess.run(
        [sys.executable, "-c", _FD_EXHAUSTION, short_dir],
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0 and out.stdout == b"ok\n", out.stderr.decode()[-2000:]
    assert os.listdir(short_dir) == []


@pytest.mark.asyncio
async def test_a_released_send_does_not_disturb_the_next_connection_to_that_name(
    plane: ControlPlane, short_dir: str, deaf: zmq.asyncio.Socket
) -> None:
    address = f"ipc://{short_dir}/deaf"
    loop = asyncio.get_running_loop()
    plane.connect("deaf", address)
    await _fill(plane, "deaf")
    old = loop.create_task(plane.send("deaf", b"old"))
    with anyio.fail_after(20):
        while plane.blocked_since("deaf") is None:
            await anyio.sleep(0.01)

    async def reconnect_and_send() -> None:
        # no checkpoint until this send waits: the old send has not woken up yet
        plane.disconnect("deaf")
        plane.connect("deaf", address)  # the same name again
        for _ in range(100_000):
            if not plane.send_nowait("deaf", FRAME):
                break
        await plane.send("deaf", b"new")

    new = loop.create_task(reconnect_and_send())
    with pytest.raises(PeerLostError):
        await old
    assert plane.blocked_since("deaf") is not None  # the new connection's wait still counts
    plane.disconnect("deaf")
    with pytest.raises(PeerLostError):
        await new


@pytest.mark.asyncio
async def test_the_pull_sockets_fd_stays_registered_and_does_not_spin_when_idle() -> None:
    """The PULL socket's FD is registered with the loop once (not around every wait),
    and reading ZMQ_EVENTS when it signals re-arms it: between bursts, and idle, the
    loop does not call the FD's callback over and over."""
    from omniwire import Endpoint

    async with (
        Endpoint("pa", address="tcp://127.0.0.1:0", host_id="host-pa") as a,
        Endpoint(
            "pb", address="tcp://127.0.0.1:0", peers={"pa": a.address}, host_id="host-pb"
        ) as b,
    ):
        await b.wait_peer("pa", 20)
        inbox = a._core.control._inbox
        loop = asyncio.get_running_loop()
        registered: list[int] = []
        add_reader = loop.add_reader

        def counting_add_reader(fd: Any, cb: Any, *args: Any) -> None:
            registered.append(fd)
            add_reader(fd, cb, *args)

        loop.add_reader = counting_add_reader  # type: ignore[method-assign]
        checks = 0
        check = inbox._check

        def counting_check() -> None:
            nonlocal checks
            checks += 1
            check()

        try:
            watch = inbox._watch
            assert watch is not None  # registered by the handshake's first wait
            loop.remove_reader(watch[1])
            add_reader(watch[1], counting_check)
            for i in range(50):
                await b.send("pa", {"i": i}, request_id=f"r{i}")
                (await a.receive(10)).release()
            busy = checks
            await anyio.sleep(0.5)
            idle = checks - busy
        finally:
            loop.add_reader = add_reader  # type: ignore[method-assign]
    assert registered == []  # 50 waits, no new registration
    assert busy >= 1  # the messages came through the watched FD
    assert idle <= 5, f"the FD callback ran {idle} times in 0.5 s of idle"


@pytest.mark.asyncio
async def test_frames_arriving_while_recv_many_waits_are_applied_in_the_reader_callback(
    short_dir: str,
) -> None:
    """With ``apply``, a frame that arrives while ``recv_many`` waits is applied in
    the socket's reader callback (not in the waiting task, a turn of the event loop
    later) and the call goes on waiting; a frame ``apply`` leaves is returned."""
    a = ControlPlane(f"ipc://{short_dir}/a")
    b = ControlPlane(f"ipc://{short_dir}/b")
    await a.start()
    await b.start()
    applied: list[tuple[bytes, bool]] = []  # (frame, applied inside a task)

    def apply(frames: list[bytes]) -> list[bytes]:
        for i, f in enumerate(frames):
            if f == b"leave":
                return frames[i:]
            applied.append((f, asyncio.current_task() is not None))
        return []

    try:
        a.connect("b", b.address)
        got: list[list[bytes]] = []

        async def waiter() -> None:
            got.append(await b.recv_many(64, apply))

        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            await anyio.sleep(0.05)  # it waits
            for f in (b"one", b"two", b"three"):
                await a.send("b", f)
            with anyio.fail_after(10):
                while len(applied) < 3:
                    await anyio.sleep(0.01)
            await anyio.sleep(0.05)
            assert not got  # all were applied: it still waits
            await a.send("b", b"leave")
        assert applied == [(b"one", False), (b"two", False), (b"three", False)]
        assert got == [[b"leave"]]
    finally:
        a.close()
        b.close()
