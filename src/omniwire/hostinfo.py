"""Who and where this process is: host identity, process token, devices.

These fill the HelloMessage (spec §4.1). Routing compares them to decide whether
a peer is in this process, on this host, or elsewhere.
"""

from __future__ import annotations

import os
import secrets
import socket
from collections.abc import Sequence
from functools import cache
from typing import Literal

from .wire import DeviceInfo

__all__ = [
    "ProcessState",
    "gpu_peer_access",
    "host_id",
    "hostname",
    "local_devices",
    "pid_alive",
    "process_state",
    "process_token",
]

_process_token = secrets.token_hex(8)


def _new_token_after_fork() -> None:
    global _process_token
    _process_token = secrets.token_hex(8)


os.register_at_fork(after_in_child=_new_token_after_fork)


def process_token() -> str:
    """Random per process (renewed in a forked child): equal tokens = same process."""
    return _process_token


@cache
def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


def host_id() -> str:
    """Identity of this host as far as shared memory goes (spec §4.1).

    ``OMNIWIRE_HOST_ID`` overrides it (tests use that to simulate two hosts).
    Otherwise: the kernel boot id and the device number of /dev/shm, so two
    containers with separate /dev/shm mounts are not "the same host".
    """
    override = os.environ.get("OMNIWIRE_HOST_ID")
    if override:
        return override
    try:
        shm_dev = os.stat("/dev/shm").st_dev
    except OSError:
        shm_dev = 0
    return f"{_boot_id()}/{shm_dev}"


def hostname() -> str:
    return socket.gethostname()[:255]


def local_devices() -> tuple[DeviceInfo, ...]:
    """The CPU, and every CUDA device this process can see (with its UUID)."""
    devices = [DeviceInfo(kind="cpu")]
    try:
        import torch

        if torch.cuda.is_available():
            for i in range(torch.cuda.device_count()):
                uuid = str(getattr(torch.cuda.get_device_properties(i), "uuid", ""))
                devices.append(DeviceInfo(kind="cuda", index=i, uuid=uuid))
    except Exception:  # a broken CUDA setup still leaves a working CPU endpoint
        pass
    return tuple(devices)


ProcessState = Literal["alive", "stopped", "zombie", "dead"]

#: pid_t is a signed 32-bit integer on Linux; larger values name no process.
_PID_MAX = 2**31 - 1


def _state_by_signal(pid: int) -> ProcessState:
    """``kill(pid, 0)``: tells a process from no process, not a zombie from a live one."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return "dead"
    except PermissionError:
        return "alive"  # it exists, owned by someone else
    return "alive"


def process_state(pid: int, *, proc_root: str = "/proc") -> ProcessState:
    """The state of process ``pid`` in this PID namespace, from ``<proc_root>/<pid>/stat``.

    Returns:
        ``"alive"`` (running or sleeping), ``"stopped"`` (by a signal or a tracer:
        it exists but runs nothing), ``"zombie"`` (it exited and its parent has not
        reaped it: it will never run again) or ``"dead"`` (no such process; also for
        pids no process can have, such as 0 or negative ones).

    Where procfs is not mounted at ``proc_root`` it falls back to ``kill(pid, 0)``,
    which cannot tell a zombie (or a stopped process) from a live one. A pid procfs
    hides (``hidepid=``) but that exists counts as alive. Never raises.
    """
    if not 0 < pid <= _PID_MAX:
        return "dead"
    try:
        with open(f"{proc_root}/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:  # no procfs here, the process is gone, or procfs hides it from us
        return _state_by_signal(pid)
    # "pid (comm) S ...": comm is free text (it may hold ") Z ("), so split at the last ")"
    fields = stat[stat.rfind(b")") + 1 :].split()
    state = fields[0] if fields else b"?"
    if state == b"Z":
        return "zombie"
    if state in (b"X", b"x"):
        return "dead"
    if state in (b"T", b"t"):
        return "stopped"
    return "alive"


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` names a process in this PID namespace that may still run: alive
    or stopped. A zombie (exited, not yet reaped) is not alive. Never raises."""
    return process_state(pid) in ("alive", "stopped")


def gpu_peer_access(local: Sequence[DeviceInfo], remote: Sequence[DeviceInfo]) -> bool:
    """Whether a GPU of this process and a GPU of the peer (same host) can share memory:
    the same device, or two devices with CUDA peer access."""
    local_cuda = [d for d in local if d.kind == "cuda"]
    remote_cuda = [d for d in remote if d.kind == "cuda" and d.uuid]
    if not local_cuda or not remote_cuda:
        return False
    by_uuid = {d.uuid: d.index for d in local_cuda if d.uuid}
    try:
        import torch

        for r in remote_cuda:
            index = by_uuid.get(r.uuid)
            if index is None:
                continue  # the peer's GPU is not visible here
            for d in local_cuda:
                if d.index == index or torch.cuda.can_device_access_peer(d.index, index):
                    return True
    except Exception:
        return False
    return False
