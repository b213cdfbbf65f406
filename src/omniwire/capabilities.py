"""Shared vocabulary of routing and backends: where a peer is, what a transport can carry.

Both :mod:`omniwire.routing` and :mod:`omniwire.backends` import this module;
neither imports the other, so routing stays a pure function of declared
capabilities and never loads an engine.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["Capabilities", "Locality"]


class Locality(str, enum.Enum):
    """Where a peer is, relative to this endpoint."""

    SAME_PROCESS = "same_process"
    SAME_HOST = "same_host"
    CROSS_HOST = "cross_host"


@dataclass(frozen=True)
class Capabilities:
    """What a backend can carry; routing reads these, never backend names.

    Attributes:
        devices: memory kinds the backend delivers natively (``"cpu"``, ``"cuda"``).
            Tensors on other devices are staged through host memory.
        localities: where a peer may be for this backend to reach it.
        streaming: carries stream chunks.
        payloads: carries whole payloads (inline carries small ones only).
        host_staging: accepts tensors on devices it does not carry natively by
            staging them through host memory (they arrive on the CPU).
        max_nbytes: the largest object it carries, or None for no limit.
        progressive: the receiver can fetch byte ranges while the sender still
            writes later ones (spec §5.2).
        zero_copy: the receiver can view the bytes in place.
        mapped: the receiver reads the sender's memory directly (a shared
            mapping): importing and fetching a small object never wait on I/O, so
            the endpoint may take it on its receive loop.
        two_sided: every announced object must be imported, in announce order, even
            one the receiver refuses (a send must meet its receive, as in NCCL).
        shared_refs: one export's reference may be imported by several peers: a
            fan-out (``send([a, b], ...)``) packs once into one buffer that every
            target reads, released when the last one acknowledges. Without it a
            fan-out makes one export per target (still encoding once).
        opt_in: routed only when configured for an edge or chosen by a policy
            (e.g. it needs a process group); the reason says what to configure.
        needs_gpu_peer_access: both ends must be GPUs that can access each other.
        preference: among backends that fit an edge, the highest wins.
        layouts: the ``DataRef.layout`` values its references use (spec §4.5); a
            receiver NACKs any other ``unsupported`` before importing it.
    """

    devices: frozenset[str] = frozenset({"cpu"})
    localities: frozenset[Locality] = frozenset(Locality)
    streaming: bool = True
    payloads: bool = True
    host_staging: bool = True
    max_nbytes: int | None = None
    progressive: bool = False
    zero_copy: bool = False
    mapped: bool = False
    two_sided: bool = False
    shared_refs: bool = False
    opt_in: str | None = None
    needs_gpu_peer_access: bool = False
    preference: int = 0
    layouts: frozenset[str] = frozenset({"packed"})

    def describe(self) -> str:
        parts = [
            "devices=" + ",".join(sorted(self.devices)),
            "localities=" + ",".join(sorted(loc.value for loc in self.localities)),
        ]
        flags = (
            ("streaming", self.streaming),
            ("progressive", self.progressive),
            ("zero-copy", self.zero_copy),
            ("mapped", self.mapped),
            ("two-sided", self.two_sided),
            ("shared-refs", self.shared_refs),
            ("needs-gpu-peer-access", self.needs_gpu_peer_access),
        )
        parts += [name for name, on in flags if on]
        if self.max_nbytes is not None:
            parts.append(f"max={self.max_nbytes}B")
        if self.opt_in:
            parts.append(f"opt-in ({self.opt_in})")
        parts.append(f"preference={self.preference}")
        return " ".join(parts)
