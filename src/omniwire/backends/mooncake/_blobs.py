"""mooncake's wire blobs: its Hello info and its references, typed and validated.

Hello info (``BackendInfo.info``): msgpack ``{"session": "host:rpc_port",
"protocol": str, "pool_addr": u64, "pool_size": u64, "pieces": bool, "landing":
[addr, length, token] | nil}``. ``pieces`` (default false) says the endpoint reads
references with pieces; ``landing`` (default nil; only in a Hello addressed to one
peer) is memory of the endpoint's, registered with its engine, that the addressee
may write its objects into before it announces them (the landed form below).

Reference (``BackendRef.info``): msgpack ``{"session": str, "offset": u64,
"length": u64, "dedicated": u64, "pieces": [[at, addr, length], ...]}``.
``session`` must be the one the peer announced and ``length`` the object's length.
Exactly one of three forms:

- **pool**: ``dedicated == 0``, no pieces: bytes ``[offset, offset + length)`` of the
  peer's pool, which must lie inside the pool it announced;
- **dedicated**: ``dedicated`` is the address of a buffer the peer registered for
  this object (``offset`` is 0), which must lie outside its pool;
- **pieces** (lent tensors, sent only to a peer whose Hello says ``pieces``):
  ``offset == 0``, ``dedicated == 0``; each piece says that the bytes ``[at, at +
  length)`` of the object are at ``addr`` in the peer's memory (its caller's
  tensor, registered). Pieces are sorted by ``at``, do not overlap, have
  ``length > 0``, lie inside the object and outside the peer's pool; bytes between
  pieces are padding (unspecified).

- **landed** (a fourth form): ``"pieces": []`` and ``"landing": token`` after
  ``dedicated`` (``offset`` and ``length`` now in the *receiver's* landing that the
  token names; ``dedicated`` 0): the sender wrote the bytes there before it announced
  the object. The range must lie inside that landing.

The receiver cannot check more: the engine refuses reads of memory the peer has
not registered. Unknown fields are ignored.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from ...errors import BackendError
from ..base import PeerInfo
from ..support import check_pieces, decode_blob

__all__ = [
    "HelloInfo",
    "LandedRef",
    "Landing",
    "LandingHello",
    "Piece",
    "PiecesHello",
    "PiecesRef",
    "Ref",
    "decode_hello",
    "decode_ref",
    "encode",
    "landed_range",
    "spans",
]

U64_MAX = 2**64 - 1
U64 = Annotated[int, msgspec.Meta(ge=0)]  # msgpack integers stop at 2**64 - 1


class HelloInfo(msgspec.Struct, frozen=True):
    """The Hello info as wire 1.1 documents it (specs/wire-v1.md §9)."""

    session: str
    protocol: str
    pool_addr: U64
    pool_size: U64


class Landing(msgspec.Struct, frozen=True, array_like=True):
    """Memory the Hello's sender lent its addressee for landed objects."""

    addr: U64
    length: U64
    token: Annotated[int, msgspec.Meta(ge=1)]  # u64


class PiecesHello(HelloInfo, frozen=True):
    """What this backend announces to any peer: the 1.1 fields and ``pieces``."""

    pieces: bool = False


class LandingHello(PiecesHello, frozen=True):
    """What it reads, and announces to one peer: with the ``landing`` lent to it."""

    landing: Landing | None = None


class Piece(msgspec.Struct, frozen=True, array_like=True):
    at: U64
    addr: U64
    length: U64


class Ref(msgspec.Struct, frozen=True):
    """A pool or dedicated reference (encoded without ``pieces``)."""

    session: str
    offset: U64
    length: U64
    dedicated: U64 = 0


class PiecesRef(Ref, frozen=True):
    """A lent reference (encoded with its pieces)."""

    pieces: list[Piece] = msgspec.field(default_factory=list)


class LandedRef(PiecesRef, frozen=True):
    """Any reference (what is decoded); a landed one is encoded with an empty
    ``pieces`` and its landing's token."""

    landing: U64 = 0


# _hello_decoder and _ref_decoder read the documented 1.1 forms (the blob vectors);
# the backend reads every form with the others.
_hello_decoder = msgspec.msgpack.Decoder(HelloInfo)
_ref_decoder = msgspec.msgpack.Decoder(Ref)
_pieces_hello_decoder = msgspec.msgpack.Decoder(PiecesHello)
_pieces_ref_decoder = msgspec.msgpack.Decoder(PiecesRef)
_landing_hello_decoder = msgspec.msgpack.Decoder(LandingHello)
_landed_ref_decoder = msgspec.msgpack.Decoder(LandedRef)
encode = msgspec.msgpack.Encoder().encode


def decode_hello(peer: PeerInfo, protocol: str) -> LandingHello:
    """Decode and check a peer's Hello info.

    Raises:
        BackendError: malformed, another protocol, a bad session, a pool past the
            address space.
    """
    hello = decode_blob(
        _landing_hello_decoder, peer.info, f"mooncake hello info from {peer.name!r}"
    )
    if hello.protocol != protocol:
        raise BackendError(
            f"{peer.name!r} runs mooncake over {hello.protocol!r}, this endpoint over {protocol!r}"
        )
    if not hello.session or ":" not in hello.session:
        raise BackendError(f"{peer.name!r} announced a bad mooncake session {hello.session!r}")
    if hello.pool_addr + hello.pool_size > U64_MAX:
        raise BackendError(f"{peer.name!r} announced a mooncake pool past the address space")
    landing = hello.landing
    if landing is not None and (landing.addr + landing.length > U64_MAX or not landing.length):
        raise BackendError(
            f"{peer.name!r} lent an empty mooncake landing or one past the address space"
        )
    return hello


def decode_ref(data: bytes, hello: HelloInfo, nbytes: int, peer: str) -> LandedRef:
    """Decode a reference from ``peer`` to an object of ``nbytes`` and check what every
    form shares (its session, its length).

    Raises:
        BackendError: malformed, another session, another length.
    """
    where = f"mooncake reference from {peer!r}"
    ref = decode_blob(_landed_ref_decoder, data, where)
    if ref.session != hello.session:
        raise BackendError(
            f"{where} names session {ref.session[:80]!r}, not its own ({hello.session})"
        )
    if ref.length != nbytes:
        raise BackendError(f"{where} has length {ref.length} != {nbytes}")
    return ref


def landed_range(ref: LandedRef, token: int, size: int, peer: str) -> tuple[int, int]:
    """Where the bytes of a landed reference from ``peer`` are in the landing lent to it
    (``token``, ``size`` bytes): ``(offset, length)``.

    Raises:
        BackendError: another landing's token, pieces or a dedicated buffer with it, a
            range outside the landing.
    """
    where = f"mooncake landed reference from {peer!r}"
    if ref.landing != token:
        raise BackendError(f"{where} names landing {ref.landing}, not the one lent to it")
    if ref.pieces or ref.dedicated:
        raise BackendError(f"{where} mixes its landing with pieces or a dedicated buffer")
    if ref.offset + ref.length > size:
        raise BackendError(
            f"{where} spans [{ref.offset}, {ref.offset + ref.length}) outside its "
            f"{size}-byte landing"
        )
    return ref.offset, ref.length


def spans(ref: LandedRef, hello: HelloInfo, nbytes: int, peer: str) -> list[tuple[int, int, int]]:
    """Check a decoded reference (:func:`decode_ref`, not landed) from ``peer`` to an
    object of ``nbytes``; return where its bytes are: ``(at, remote address, length)``
    per span, sorted.

    Raises:
        BackendError: it names memory the peer does not own or outside it.
    """
    where = f"mooncake reference from {peer!r}"
    if ref.landing:
        raise BackendError(f"{where} names a landing this endpoint did not lend it")
    pool_lo, pool_hi = hello.pool_addr, hello.pool_addr + hello.pool_size

    def outside_pool(addr: int, length: int) -> bool:
        end = addr + length
        return end <= U64_MAX and not (addr < pool_hi and end > pool_lo)

    if ref.pieces:
        if ref.offset or ref.dedicated:
            raise BackendError(f"{where} mixes pieces with a pool offset or a dedicated buffer")
        check_pieces([(p.at, p.length) for p in ref.pieces], nbytes, where)
        for p in ref.pieces:
            if not outside_pool(p.addr, p.length):
                raise BackendError(
                    f"{where} has a piece at 0x{p.addr:x} that is not memory of its own "
                    "outside its pool"
                )
        return [(p.at, p.addr, p.length) for p in ref.pieces]
    if ref.dedicated == 0:
        if ref.offset + ref.length > hello.pool_size:
            raise BackendError(
                f"{where} spans [{ref.offset}, {ref.offset + ref.length}) outside its "
                f"{hello.pool_size}-byte pool"
            )
        return [(0, hello.pool_addr + ref.offset, nbytes)]
    if ref.offset != 0 or not outside_pool(ref.dedicated, ref.length):
        raise BackendError(
            f"{where} names a dedicated buffer [0x{ref.dedicated:x}, "
            f"0x{ref.dedicated + ref.length:x}) + {ref.offset} that is not a buffer of its own "
            "outside its pool"
        )
    return [(0, ref.dedicated, nbytes)]
