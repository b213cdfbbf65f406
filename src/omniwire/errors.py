"""Every exception omniwire raises derives from :class:`OmniwireError`.

Errors say whose fault they are, the way h11 does: a ``Remote...`` error means a
peer sent something wrong, a ``Local...`` error means this process asked for
something impossible.
"""

from __future__ import annotations

from typing import TypeVar

__all__ = [
    "AckTimeoutError",
    "AddressError",
    "AddressInUseError",
    "BackendClosedError",
    "BackendError",
    "BackendUnavailableError",
    "BadReferenceError",
    "BufferReleasedError",
    "ConfigurationError",
    "DigestMismatchError",
    "DrainTimeoutError",
    "EndpointClosedError",
    "EndpointNotStartedError",
    "FrameTooLargeError",
    "HandshakeError",
    "LocalProtocolError",
    "NameClashError",
    "NoRouteError",
    "OmniwireError",
    "PeerClosedError",
    "PeerLostError",
    "PeerNameMismatchError",
    "PeerRefusedError",
    "PeerUnresponsiveError",
    "ProtocolError",
    "RemoteProtocolError",
    "RequestAbortedError",
    "ShmFullError",
    "UnknownNameError",
    "UnsupportedVersionError",
    "WireFormatError",
]


def reason_text(why: object, default: str) -> str:
    """(internal) ``why`` as the reason in an error message, never empty: an exception whose
    text is empty says its type, and ``None`` or an empty text says ``default``."""
    text = "" if why is None else str(why).strip()
    if text:
        return text
    if isinstance(why, BaseException):
        return type(why).__name__
    return default


def described(exc: BaseException) -> str:
    """(internal) ``Type: text`` of an exception for a message, or ``Type`` where its text is empty."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class OmniwireError(Exception):
    """Root of every error omniwire raises."""


class WireFormatError(OmniwireError, ValueError):
    """Bytes that are not a valid omniwire frame, message or payload header.

    Raised by :func:`omniwire.wire.decode` and :func:`omniwire.codec.loads` for any
    malformed, truncated, oversized, wrong-type or wrong-version input. The message
    says what was wrong and, where it can, at which field.
    """


class UnsupportedVersionError(WireFormatError):
    """A frame or peer uses a wire major version this reader does not speak."""

    def __init__(self, message: str, *, major: int, minor: int) -> None:
        super().__init__(message)
        self.major = major
        self.minor = minor


class BufferReleasedError(OmniwireError, ValueError):
    """A transport buffer (``Endpoint.empty``) was used after its ``release()``."""


class FrameTooLargeError(OmniwireError, ValueError):
    """A message would not fit in one frame (spec §3.1: 16 MiB): its own send fails,
    nothing else is affected. Bulk bytes belong in a tensor, which travels by backend."""


class ProtocolError(OmniwireError):
    """A message that is well-formed but illegal in the current state."""


class RemoteProtocolError(ProtocolError):
    """The peer broke the protocol (e.g. an ACK for an object it was never sent)."""


class LocalProtocolError(ProtocolError):
    """This process tried something the protocol forbids (e.g. data before Hello)."""


class BackendError(OmniwireError):
    """A data-plane backend failed to move bytes (engine error, bad reference)."""


class DigestMismatchError(BackendError):
    """The bytes read for an object do not match the digest its sender computed
    (``Endpoint(digest=True)``): corrupted on the way (NACK reason ``digest_mismatch``)."""


class BadReferenceError(BackendError):
    """A peer's backend reference is malformed, names memory the peer does not own,
    or lies outside it: the peer's fault (NACK reason ``malformed``), not the engine's."""


class BackendUnavailableError(BackendError):
    """A backend cannot run here; ``reason`` says why and ``hint`` how to fix it."""

    def __init__(self, name: str, reason: str, hint: str = "") -> None:
        text = f"backend {name!r} is not available: {reason}"
        if hint:
            text += f". {hint}"
        super().__init__(text)
        self.name = name
        self.reason = reason
        self.hint = hint


class BackendClosedError(BackendError):
    """The backend was closed; no further transfers are possible."""


class ShmFullError(BackendError, MemoryError):
    """``/dev/shm`` has no room for a segment of the size needed."""


class NoRouteError(OmniwireError):
    """A routing policy found no backend for an edge; lists each candidate's rejection."""

    def __init__(self, message: str, rejected: tuple[tuple[str, str], ...] = ()) -> None:
        if rejected:
            message += "; " + "; ".join(f"{name}: {why}" for name, why in rejected)
        super().__init__(message)
        self.rejected = rejected


class ConfigurationError(OmniwireError, ValueError):
    """An Endpoint option is unusable; the message names the option and the value.

    Raised by the constructor or ``start()``; nothing is left behind.
    """


class AddressError(ConfigurationError):
    """A control address is not one ZeroMQ can use (``ipc:/x``, ``tpc://…``, an ipc
    path over the unix-socket limit)."""


class AddressInUseError(ConfigurationError):
    """The control address is already served (a live endpoint on that ipc path, a
    tcp port in use)."""


class UnknownNameError(ConfigurationError, KeyError):
    """A backend, policy or route names something that is not registered."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class HandshakeError(OmniwireError):
    """A peer did not complete the Hello exchange, or was refused."""


class PeerRefusedError(HandshakeError):
    """The peer refused this endpoint (a RefusalMessage); ``code`` says why (spec §4.9)."""

    def __init__(self, message: str, *, peer: str = "", code: str = "") -> None:
        super().__init__(message)
        self.peer = peer
        self.code = code


class NameClashError(PeerRefusedError):
    """Another live endpoint already uses this stage name (``name_in_use``/``own_name``)."""


class PeerNameMismatchError(PeerRefusedError):
    """``peers=`` names a stage that, at that address, calls itself something else."""


class PeerLostError(OmniwireError):
    """A peer died, restarted or disconnected while transfers to it were in flight."""

    @classmethod
    def of(cls: type[_Lost], peer: str, reason: object, *, closed: bool = False) -> _Lost:
        """The error for ``peer`` gone for ``reason`` (never an empty one)."""
        what = "closed" if closed else "was lost"
        return cls(f"peer {peer!r} {what}: {reason_text(reason, 'no reason known')}")


_Lost = TypeVar("_Lost", bound=PeerLostError)


class PeerClosedError(PeerLostError):
    """The peer closed cleanly (it said Goodbye) while transfers to it were in flight."""


class PeerUnresponsiveError(PeerLostError):
    """The peer is alive but takes no frames (stopped, hung or wedged)."""


class AckTimeoutError(OmniwireError, TimeoutError):
    """A peer did not acknowledge an object (or grant a credit) within the ACK timeout."""


class DrainTimeoutError(OmniwireError, TimeoutError):
    """``drain`` found objects still unacknowledged after its timeout."""


class RequestAbortedError(OmniwireError):
    """The request was aborted (locally or by a peer) before the transfer finished."""


class EndpointClosedError(OmniwireError):
    """The endpoint is closed."""


class EndpointNotStartedError(EndpointClosedError):
    """The endpoint was not started: use ``async with Endpoint(...)`` or ``await start()``."""
