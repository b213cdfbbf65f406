"""Helpers of the conformance suite that tests use on their own too: a peer process,
an ipc address, the backend class (or a skip with its reason), a payload on a device."""

from __future__ import annotations

import os
import secrets
import subprocess
import tempfile
from typing import Any

import numpy as np
import pytest
import torch

from ... import registry
from .. import _warm as warm

__all__ = ["PeerProcess", "ipc_address", "require_backend", "to_device"]


def to_device(value: Any, device: str) -> Any:
    """``value`` with every tensor moved to ``device`` (containers rebuilt). Off the
    CPU, numpy arrays become tensors there too: a GPU-only backend carries nothing
    else, and a payload holding a CPU array would route elsewhere."""
    if device == "cpu":
        return value
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(value)).to(device)
    if type(value) is list:
        return [to_device(v, device) for v in value]
    if type(value) is tuple:
        return tuple(to_device(v, device) for v in value)
    if type(value) is dict:
        return {k: to_device(v, device) for k, v in value.items()}
    return value


def require_backend(name: str) -> type[Any]:
    """The backend class, or skip (fail under OMNIWIRE_REQUIRE_ENGINES=1) with the reason."""
    try:
        entry = registry.backend_status(name)
    except KeyError:
        pytest.fail(f"backend {name!r} is not registered (is its package installed?)")
    if entry.status == "available" and entry.cls is not None:
        return entry.cls
    reason = f"backend {name!r} is {entry.status}: {entry.error}"
    needs_gpu = bool(getattr(entry.cls, "needs_gpu", False))
    if os.environ.get("OMNIWIRE_REQUIRE_ENGINES") == "1" and not needs_gpu:
        pytest.fail(reason + " (OMNIWIRE_REQUIRE_ENGINES=1: engines that run on a CPU must load)")
    pytest.skip(reason)


def ipc_address(name: str) -> str:
    base = os.path.join(tempfile.gettempdir(), f"owt-{os.getuid()}")
    return f"ipc://{base}/{name}-{secrets.token_hex(4)}"


class PeerProcess:
    """``python -m omniwire.peer`` in a child process; its exit code is checked."""

    def __init__(
        self, name: str, address: str, *args: str, env: dict[str, str] | None = None
    ) -> None:
        self.name = name
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        peer_args = ["--name", name, "--address", address, *args]
        # forked from a process that imported torch already: ~2.5 s less per peer
        self.proc = warm.start(["-m", "omniwire.peer", *peer_args], full_env)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if not line.startswith("READY "):
            self.proc.kill()
            raise RuntimeError(
                f"peer {name} did not start (said {line!r}, exit {self.proc.wait()})"
            )
        self.address = line.split(" ", 1)[1]
        self.output = ""

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM the peer and return its exit code (killing it after ``timeout``)."""
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            code = -9
        self._close_pipe()
        return code

    def kill(self) -> None:
        """SIGKILL the peer (a crash, as far as its peers can tell)."""
        self.proc.kill()
        self.proc.wait()
        self._close_pipe()

    def _close_pipe(self) -> None:
        if self.proc.stdout is not None and not self.proc.stdout.closed:
            self.output = self.proc.stdout.read()
            self.proc.stdout.close()
