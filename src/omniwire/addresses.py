"""Control addresses: what omniwire hands to ZeroMQ, checked first (spec §3.3).

:func:`parse_address` turns text into an :class:`Address` or raises an
:class:`~omniwire.errors.AddressError` that names the value and why;
:func:`probe_ipc` refuses an ipc path a live process serves (libzmq's bind would
silently steal it) and removes a dead one's socket file.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import re
import socket
import stat
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import zmq

from .errors import AddressError, AddressInUseError

__all__ = [
    "ABORT_SUFFIX",
    "IPC_PATH_MAX",
    "Address",
    "advertised",
    "file_id",
    "parse_address",
    "primary_ip",
    "probe_ipc",
]

log = logging.getLogger("omniwire.control")

#: sizeof(sockaddr_un.sun_path) - 1: the longest ipc path libzmq binds or connects.
IPC_PATH_MAX: int = getattr(zmq, "IPC_PATH_MAX_LEN", 107) or 107
#: The PUB socket binds ``<path>.abort``, so a bound ipc path leaves room for it.
ABORT_SUFFIX = ".abort"
#: No usable address is longer (a 253-byte host name, brackets, a port).
MAX_ADDRESS_LENGTH = 512

_WILDCARD_HOSTS = ("*", "0.0.0.0", "::")
_HOSTNAME = re.compile(
    r"(?=.{1,253}\Z)[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
    r"(?:\.[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?)*\.?\Z"
)
_PORT = re.compile(r"[0-9]{1,5}\Z")


# -- addresses ------------------------------------------------------------------------


@dataclass(frozen=True)
class Address:
    """A control address omniwire can hand to ZeroMQ, in parts.

    ``ipc``: ``path`` is a filesystem path (absolute, or relative to the working
    directory) or ``@name`` (Linux abstract namespace: no file). ``tcp``: ``host``
    is a host name, an IPv4 address or an IPv6 address (without brackets), or ``*``;
    ``port`` is 1–65535, or 0 for "any free port" (bind only). ``str()`` gives the
    canonical form.
    """

    scheme: Literal["ipc", "tcp"]
    path: str = ""
    host: str = ""
    port: int = 0

    def __str__(self) -> str:
        if self.scheme == "ipc":
            return f"ipc://{self.path}"
        host = f"[{self.host}]" if self.is_ipv6 else self.host
        return f"tcp://{host}:{self.port or '*'}"

    @property
    def is_ipv6(self) -> bool:
        """A tcp address whose host is an IPv6 literal (ZeroMQ needs ``IPV6`` for it)."""
        return self.scheme == "tcp" and ":" in self.host

    @property
    def is_wildcard(self) -> bool:
        """A tcp address on every interface (``*``, ``0.0.0.0``, ``[::]``)."""
        return self.scheme == "tcp" and self.host in _WILDCARD_HOSTS

    @property
    def file(self) -> str | None:
        """The socket file an ipc address binds (None for tcp and abstract names)."""
        if self.scheme == "ipc" and not self.path.startswith("@"):
            return self.path
        return None

    def abort_address(self) -> Address:
        """Where the PUB socket for aborts binds: beside the ipc path, or the same
        host on any free tcp port."""
        if self.scheme == "ipc":
            return Address("ipc", path=self.path + ABORT_SUFFIX)
        return Address("tcp", host=self.host, port=0)


def _shown(text: str) -> str:
    return repr(text if len(text) <= 120 else text[:120] + "…")


def parse_address(text: str, *, what: str = "address", bind: bool = False) -> Address:
    """Check a control address and split it into an :class:`Address`.

    Accepted: ``ipc:///abs/path``, ``ipc://relative/path``, ``ipc://@abstract``, and
    ``tcp://host:port`` with a host name, an IPv4 address or a bracketed IPv6
    address (``tcp://[::1]:5555``). With ``bind=True`` (an address to bind) also the
    port ``*`` or ``0`` (any free port), the wildcard hosts ``*``, ``0.0.0.0`` and
    ``[::]``, and the ipc path must leave room for the ``.abort`` suffix of the
    abort socket beside it (at most ``IPC_PATH_MAX - 6`` = 101 bytes; 107 to connect).

    Args:
        text: the address.
        what: what the address is, for the error message ("peer 'b' address").
        bind: whether the address is to be bound (else connected to).

    Returns:
        The parsed address; ``str()`` of it is the canonical form.

    Raises:
        AddressError: the address is not one ZeroMQ can use as asked; the message
            names ``what``, the value and why (unknown scheme, ``ipc:/x``, an empty
            or too long ipc path, ``ipc://*``, a bad, missing or — to connect —
            ephemeral port, a wildcard host to connect to, an IPv6 address without
            brackets, a control character, an absurd length).
    """

    def bad(why: str) -> AddressError:
        return AddressError(f"{what} {_shown(text)} is not a usable control address: {why}")

    if not isinstance(text, str):
        raise AddressError(f"{what} must be a string like 'ipc:///path', not {type(text).__name__}")
    if len(text) > MAX_ADDRESS_LENGTH:
        raise bad(f"it is {len(text)} characters long (limit {MAX_ADDRESS_LENGTH})")
    if not text.isprintable():
        raise bad("it contains a control or non-printing character")
    scheme, sep, rest = text.partition("://")
    if not sep:
        if re.match(r"(ipc|tcp):/?[^/]", text):
            raise bad(
                f"write {text[:3]}:// (two slashes), e.g. 'ipc:///tmp/x' or 'tcp://host:5555'"
            )
        raise bad("it has no scheme: use 'ipc:///path' on one host or 'tcp://host:port'")
    if scheme == "ipc":
        return _parse_ipc(rest, bind, bad)
    if scheme == "tcp":
        return _parse_tcp(rest, bind, bad)
    raise bad(f"scheme {scheme!r} is not one omniwire uses (ipc, tcp)")


def _parse_ipc(path: str, bind: bool, bad: Callable[[str], AddressError]) -> Address:
    if not path:
        raise bad("the ipc path is empty")
    if path == "*":
        raise bad("ipc://* (a random path) cannot be advertised: name a path")
    try:
        size = len(path.encode())
    except UnicodeEncodeError:
        raise bad("the ipc path is not valid UTF-8") from None
    limit = IPC_PATH_MAX - len(ABORT_SUFFIX) if bind else IPC_PATH_MAX
    if size > limit:
        why = f" (with room for {ABORT_SUFFIX!r})" if bind else ""
        raise bad(f"the ipc path is {size} bytes; a unix socket path holds at most {limit}{why}")
    if path.endswith("/"):
        raise bad("the ipc path names a directory")
    return Address("ipc", path=path)


def _parse_tcp(rest: str, bind: bool, bad: Callable[[str], AddressError]) -> Address:
    if rest.startswith("["):
        host, sep, port = rest[1:].partition("]")
        if not sep or not port.startswith(":"):
            raise bad("write an IPv6 address as [addr]:port")
        port = port[1:]
        try:
            host = str(ipaddress.IPv6Address(host))
        except ValueError:
            raise bad("the host in brackets is not an IPv6 address") from None
    else:
        host, sep, port = rest.rpartition(":")
        if not sep:
            raise bad("the port is missing: tcp://host:port")
        if ":" in host:
            raise bad("write an IPv6 address in brackets: tcp://[addr]:port")
        if not host:
            raise bad("the host is missing: tcp://host:port")
        if host != "*" and not _HOSTNAME.match(host):
            raise bad("the host is not a host name or an IP address")
        if re.fullmatch(r"[0-9.]+", host):
            try:
                ipaddress.IPv4Address(host)
            except ValueError:
                raise bad("the host is not an IPv4 address") from None
    if host in _WILDCARD_HOSTS and not bind:
        raise bad(f"the host {host!r} means every interface: it can be bound, not connected to")
    if port in ("*", "0"):
        if not bind:
            raise bad("a port to connect to cannot be '*' or 0")
        return Address("tcp", host=host, port=0)
    if not _PORT.match(port) or not 1 <= int(port) <= 65535:
        raise bad("the port is not a number from 1 to 65535")
    return Address("tcp", host=host, port=int(port))


def primary_ip() -> str:
    """This host's address as others see it (the route to a public address), or loopback."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("192.0.2.1", 9))  # no packet is sent: this only picks a route
            return str(probe.getsockname()[0])
    except OSError:
        return "127.0.0.1"


def advertised(address: str) -> str:
    """A bound address as peers should dial it: a wildcard host becomes this host's IP;
    a relative ipc path becomes absolute (other processes have other working
    directories) where the absolute path still fits a unix socket address."""
    if address.startswith("tcp://"):
        host, _, port = address[len("tcp://") :].rpartition(":")
        if host in ("0.0.0.0", "*", "[::]", "::"):
            return f"tcp://{primary_ip()}:{port}"
    elif address.startswith("ipc://") and not address.startswith(("ipc:///", "ipc://@")):
        absolute = os.path.abspath(address[len("ipc://") :])
        if len(absolute.encode()) <= IPC_PATH_MAX:
            return f"ipc://{absolute}"
    return address


# -- ipc socket files ------------------------------------------------------------------


def probe_ipc(addr: Address, what: str) -> None:
    """Refuse an ipc address another process serves, before ZeroMQ binds it: libzmq's
    ipc bind unlinks whatever is at the path, silently stealing a live endpoint's
    address. A socket file nobody listens on (a crashed process's) is removed.

    Raises:
        AddressInUseError: a process accepts connections there.
        AddressError: the path exists and is not a socket, or cannot be checked.
    """
    path = addr.path
    target = "\0" + path[1:] if path.startswith("@") else path
    if addr.file is not None:
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            return
        except OSError as exc:
            raise AddressError(f"{what} {str(addr)!r}: cannot check {path!r}: {exc}") from exc
        if not stat.S_ISSOCK(mode):
            raise AddressError(
                f"{what} {str(addr)!r}: {path!r} exists and is not a socket "
                "(binding would delete it)"
            )
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.setblocking(False)
        try:
            probe.connect(target)
        except (ConnectionRefusedError, FileNotFoundError):
            if addr.file is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)  # stale: its process is gone
                log.info("removed the stale socket file %s", path)
            return
        except BlockingIOError:
            pass  # a listener with a full backlog: in use
        except OSError as exc:
            raise AddressError(f"{what} {str(addr)!r}: cannot check {path!r}: {exc}") from exc
    raise AddressInUseError(f"{what} {str(addr)!r} is in use: a live process listens on it")


def file_id(path: str) -> tuple[int, int] | None:
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino
