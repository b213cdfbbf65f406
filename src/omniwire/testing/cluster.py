"""Hosts as network namespaces on one machine, for cross-host tests (needs root).

A :class:`Cluster` makes two or three "hosts". Each is

- a network namespace with one veth interface into a bridge that lives in a
  namespace of its own (the "switch"), so nothing touches the machine's own
  network; addresses come from 198.18.0.0/15, the range set aside for network
  benchmarks (RFC 2544);
- a ``tbf`` bandwidth cap on the host's egress (``rate``), so bandwidth is finite;
- a mount namespace with a private tmpfs on /dev/shm, held open by an anchor
  process, so :func:`omniwire.hostinfo.host_id` differs between hosts with no
  ``OMNIWIRE_HOST_ID`` override, while every process of one host shares its /dev/shm.

Processes enter a host with ``nsenter`` (:meth:`Host.command`, :meth:`Host.popen`).
:meth:`Host.link_down` / :meth:`Host.link_up` partition a host from all others and
heal it; :meth:`Host.kill_all` kills every process of a host at once (a host dying).
:meth:`Cluster.close` (also on ``__exit__``) kills every process left in any host,
then deletes every namespace, which removes every link and mount with it.
Namespaces are named ``owc-<pid>-<tag>-<host>``: a cluster whose creator died
(SIGKILL) is swept by the next one made on this machine.

Traffic goes only between these namespaces. Nothing here is for production.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any

from ..hostinfo import pid_alive

__all__ = ["Cluster", "ClusterUnavailableError", "Host", "cluster_or_skip"]

_PREFIX = "owc-"
_NETWORK = "198.18.{subnet}.{host}"


class ClusterUnavailableError(RuntimeError):
    """Namespaces cannot be made here (not root, or no ``ip``/``unshare``/``nsenter``)."""


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=20)
    except FileNotFoundError:
        raise ClusterUnavailableError(
            f"{argv[0]} is not installed (apt-get install iproute2 util-linux)"
        ) from None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = _run(["ip", *args])
    if check and done.returncode != 0:
        raise ClusterUnavailableError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


def _netns_pids(netns: str) -> list[int]:
    done = _ip("netns", "pids", netns, check=False)
    return [int(p) for p in done.stdout.split()] if done.returncode == 0 else []


class Host:
    """One namespace "host": its name, interface, address and processes."""

    def __init__(self, name: str, netns: str, ifname: str, ip: str) -> None:
        self.name = name
        self.netns = netns
        self.ifname = ifname
        self.ip = ip
        self.anchor: subprocess.Popen[bytes] | None = None

    def __repr__(self) -> str:
        return f"<Host {self.name} {self.ip} dev {self.ifname} netns {self.netns}>"

    def _start_anchor(self) -> None:
        # ip netns exec and unshare exec (no fork): the Popen's pid is the sleep's
        script = "mount -t tmpfs -o size=2g tmpfs /dev/shm && echo ready && exec sleep 100000"
        self.anchor = subprocess.Popen(
            ["ip", "netns", "exec", self.netns, "unshare", "--mount", "--propagation",
             "private", "sh", "-c", script],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )  # fmt: skip
        assert self.anchor.stdout is not None
        if self.anchor.stdout.readline().strip() != b"ready":
            self.anchor.kill()
            _, err = self.anchor.communicate(timeout=10)
            raise ClusterUnavailableError(
                f"no private /dev/shm in {self.netns}: {err.decode(errors='replace').strip()}"
            )

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this host (its network and its /dev/shm)."""
        assert self.anchor is not None
        return ["nsenter", "-t", str(self.anchor.pid), "-n", "-m", f"--wd={os.getcwd()}", "--",
                *argv]  # fmt: skip

    def popen(self, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside this host; keyword arguments go to ``subprocess.Popen``."""
        return subprocess.Popen(self.command(argv), **kwargs)

    def run(self, argv: Sequence[str], timeout: float = 60, **kwargs: Any) -> Any:
        return subprocess.run(self.command(argv), timeout=timeout, **kwargs)

    def shm(self) -> list[str]:
        """The names in this host's /dev/shm."""
        assert self.anchor is not None
        try:
            return sorted(os.listdir(f"/proc/{self.anchor.pid}/root/dev/shm"))
        except OSError:
            return []

    def link_down(self) -> None:
        """Cut this host off from every other (its veth goes down; sockets stay open)."""
        _ip("-n", self.netns, "link", "set", self.ifname, "down")

    def link_up(self) -> None:
        _ip("-n", self.netns, "link", "set", self.ifname, "up")

    def set_rate(self, rate: str) -> None:
        """Change this host's egress cap (``tc tbf`` syntax, e.g. ``"200mbit"``)."""
        tc = _run(["tc", "-n", self.netns, "qdisc", "replace", "dev", self.ifname, "root",
                   "tbf", "rate", rate, "burst", "4mb", "latency", "100ms"])  # fmt: skip
        if tc.returncode != 0:
            raise ClusterUnavailableError(f"tc tbf on {self.ifname}: {tc.stderr.strip()}")

    def pids(self) -> list[int]:
        """Every process in this host except its anchor."""
        anchor = self.anchor.pid if self.anchor is not None else -1
        return [p for p in _netns_pids(self.netns) if p != anchor]

    def kill_all(self) -> list[int]:
        """SIGKILL every process of this host (its anchor stays: /dev/shm can be read)."""
        pids = self.pids()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return pids


class Cluster:
    """Two or three namespace hosts on one bridge; a context manager.

    ``rate`` caps each host's egress (``tc tbf`` syntax, e.g. ``"10gbit"``), one
    value for all or one per host name. Raises :class:`ClusterUnavailableError`
    where namespaces cannot be made.
    """

    def __init__(self, names: Sequence[str] = ("a", "b", "c"), *,
                 rate: str | Mapping[str, str] = "10gbit") -> None:  # fmt: skip
        if not 1 <= len(names) <= 8 or len(set(names)) != len(names):
            raise ValueError(f"1-8 distinct host names, not {list(names)}")
        self.tag = secrets.token_hex(3)
        self.switch = f"{_PREFIX}{os.getpid()}-{self.tag}-sw"
        subnet = 1 + secrets.randbelow(250)
        self.hosts: dict[str, Host] = {}
        for i, name in enumerate(names):
            if not name.isalnum() or len(name) > 4:
                raise ValueError(f"host name {name!r}: 1-4 letters or digits")
            host = Host(
                name,
                f"{_PREFIX}{os.getpid()}-{self.tag}-{name}",
                f"ow{self.tag}{name}",  # at most 12 characters, the switch side 13
                _NETWORK.format(subnet=subnet, host=i + 1),
            )
            self.hosts[name] = host
        self._rates = {n: rate if isinstance(rate, str) else rate[n] for n in names}
        self._closed = False
        try:
            self._create()
        except BaseException:
            self.close()
            raise

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def __enter__(self) -> Cluster:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _create(self) -> None:
        if os.geteuid() != 0:
            raise ClusterUnavailableError("network namespaces need root")
        for tool in ("unshare", "nsenter"):
            if shutil.which(tool) is None:
                raise ClusterUnavailableError(f"{tool} is not installed (util-linux)")
        sweep()
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for host in self.hosts.values():
            _ip("netns", "add", host.netns)
            _ip("link", "add", host.ifname, "netns", host.netns, "type", "veth",
                "peer", "name", host.ifname + "p", "netns", self.switch)  # fmt: skip
            _ip("-n", self.switch, "link", "set", host.ifname + "p", "master", "br0", "up")
            _ip("-n", host.netns, "addr", "add", f"{host.ip}/24", "dev", host.ifname)
            _ip("-n", host.netns, "link", "set", "lo", "up")
            _ip("-n", host.netns, "link", "set", host.ifname, "up")
            host.set_rate(self._rates[host.name])
            host._start_anchor()

    def close(self) -> None:
        """Kill every process in every host, delete every namespace. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for host in self.hosts.values():
            host.kill_all()
        for host in self.hosts.values():
            if host.anchor is not None:
                host.anchor.kill()
                host.anchor.communicate(timeout=10)
        for netns in [h.netns for h in self.hosts.values()] + [self.switch]:
            _delete(netns)


def _delete(netns: str) -> None:
    deadline = time.monotonic() + 10
    while (pids := _netns_pids(netns)) and time.monotonic() < deadline:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
    _ip("netns", "del", netns, check=False)


def sweep() -> list[str]:
    """Delete the namespaces of clusters whose creating process is gone."""
    done = _ip("netns", "list", check=False)
    swept = []
    for line in done.stdout.splitlines():
        name = line.split(" ", 1)[0]
        if not name.startswith(_PREFIX):
            continue
        try:
            creator = int(name[len(_PREFIX) :].split("-", 1)[0])
        except ValueError:
            continue
        if not pid_alive(creator):
            _delete(name)
            swept.append(name)
    return swept


def cluster_or_skip(names: Sequence[str] = ("a", "b", "c"), **kwargs: Any) -> Cluster:
    """A :class:`Cluster`, or skip the test with the reason (fail instead under
    ``OMNIWIRE_REQUIRE_ENGINES=1``: CI runs as root and must run these tests)."""
    import pytest

    try:
        return Cluster(names, **kwargs)
    except ClusterUnavailableError as exc:
        if os.environ.get("OMNIWIRE_REQUIRE_ENGINES") == "1":
            pytest.fail(f"no namespace cluster (OMNIWIRE_REQUIRE_ENGINES=1): {exc}")
        pytest.skip(f"no namespace cluster: {exc}")
