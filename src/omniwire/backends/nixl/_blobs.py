"""nixl's wire blobs: its Hello info and its references, typed and validated.

Hello info (``BackendInfo.info``): msgpack ``{"agent": str, "metadata": bytes,
"pools": [[addr, length, dev, mem], ...], "pieces": bool}`` — the agent name, its
``get_agent_metadata()`` blob (taken once the pools are registered), the pools,
and (default false) whether the endpoint reads references with pieces. The
metadata blob is NIXL's own serialization (``nixlSerDes``: tagged,
length-prefixed binary, parsed in C++ by ``nixlAgent::loadRemoteMD``; no pickle).
Before it is loaded, the agent name written in it must be the one announced.

Reference (``BackendRef.info``): msgpack ``{"pool": int, "offset": u64,
"length": u64, "region": [addr, length, dev, mem] | nil, "metadata": bytes}``,
plus ``"lent"`` and ``"pieces"`` in the third form. ``length`` is the object's.
Exactly one of three forms:

- **pool** (``pool >= 0``): bytes ``[offset, offset + length)`` of that pool of the
  announcing peer, which must lie inside it;
- **dedicated** (``pool == -1``): a dedicated registration ``region``, described by
  ``metadata`` (``get_partial_agent_metadata`` of that one region, which must name
  the peer's agent); the bytes are ``[offset, offset + length)`` of the region;
- **pieces** (``pool == -2``; lent tensors, sent only to a peer whose Hello says
  ``pieces``): ``"lent": [[region, metadata], ...]`` are registrations of the
  peer's own memory (each with its partial metadata), ``"pieces": [[at, addr,
  length, lent], ...]`` say that bytes ``[at, at + length)`` of the object are at
  ``addr`` inside registration ``lent``. Pieces are sorted by ``at``, do not
  overlap, have ``length > 0`` and lie inside the object; bytes between pieces are
  padding (unspecified).

**Landings** (spec §9.5): a Hello addressed to one peer may end with ``"landing":
[region, metadata, token]``, host memory of the Hello's writer registered with its
agent (``metadata``: that registration's partial metadata) that the addressee may
WRITE objects into before it announces them. A fourth reference form, **landed**
(``pool == -3``; ``region`` nil, ``metadata`` empty, ``lent`` and ``pieces`` empty,
then ``"landing": token``), says the object's bytes are ``[offset, offset + length)``
of the landing the receiver lent that peer under ``token``.

A region named by a dedicated or lent reference must not overlap the peer's pools.
Descriptors always travel in these structs: NIXL's
``get_serialized_descs``/``deserialize_descs`` use pickle and are never called.
Unknown fields are ignored.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Annotated, Literal

import msgspec

from ...errors import BackendError
from ..base import PeerInfo
from ..support import check_pieces, decode_blob

__all__ = [
    "HelloInfo",
    "LandedRef",
    "Landing",
    "LandingHello",
    "Lent",
    "Piece",
    "PiecesHello",
    "PiecesRef",
    "Ref",
    "Region",
    "Span",
    "decode_hello",
    "encode",
    "landed_range",
    "md_agent",
    "resolve",
]

U64_MAX = 2**64 - 1
U64 = Annotated[int, msgspec.Meta(ge=0)]  # msgpack integers stop at 2**64 - 1
Mem = Literal["DRAM", "VRAM"]
#: Largest metadata blob accepted from a peer.
MAX_METADATA = 1 << 20
POOL, DEDICATED, PIECES, LANDED = 0, -1, -2, -3


class Region(msgspec.Struct, frozen=True, array_like=True):
    addr: U64
    length: U64
    dev: U64 = 0
    mem: Mem = "DRAM"

    @property
    def key(self) -> tuple[int, int, int, str]:
        return (self.addr, self.length, self.dev, self.mem)

    def overlaps(self, other: Region) -> bool:
        return (
            self.mem == other.mem
            and self.dev == other.dev
            and self.addr < other.addr + other.length
            and other.addr < self.addr + self.length
        )


class HelloInfo(msgspec.Struct, frozen=True):
    """The Hello info as wire 1.1 documents it (specs/wire-v1.md §9)."""

    agent: str
    metadata: bytes
    pools: list[Region]


class PiecesHello(HelloInfo, frozen=True):
    """What this backend announces and reads: the 1.1 fields and ``pieces``."""

    pieces: bool = False


class Landing(msgspec.Struct, frozen=True, array_like=True):
    """Host memory the Hello's writer lent its addressee for landed objects."""

    region: Region
    metadata: bytes
    token: Annotated[int, msgspec.Meta(ge=1)]  # u64


class LandingHello(PiecesHello, frozen=True):
    """What the backend reads, and announces to one peer: with its ``landing``."""

    landing: Landing | None = None


class Ref(msgspec.Struct, frozen=True):
    pool: Annotated[int, msgspec.Meta(ge=-1, le=255)]
    offset: U64
    length: U64
    region: Region | None = None
    metadata: bytes = b""


class Lent(msgspec.Struct, frozen=True, array_like=True):
    region: Region
    metadata: bytes


class Piece(msgspec.Struct, frozen=True, array_like=True):
    at: U64
    addr: U64
    length: U64
    lent: Annotated[int, msgspec.Meta(ge=0)]


class PiecesRef(msgspec.Struct, frozen=True):
    """Any reference (what the backend decodes); a lent one is encoded with its pieces.
    The 1.1 fields, ``pool`` also -2, then ``lent`` and ``pieces``."""

    pool: Annotated[int, msgspec.Meta(ge=-2, le=255)]
    offset: U64
    length: U64
    region: Region | None = None
    metadata: bytes = b""
    lent: list[Lent] = msgspec.field(default_factory=list)
    pieces: list[Piece] = msgspec.field(default_factory=list)


class LandedRef(PiecesRef, frozen=True):
    """Any reference, the landed form included (what the backend decodes first); a
    landed one is encoded with empty ``lent`` and ``pieces`` and its token."""

    pool: Annotated[int, msgspec.Meta(ge=-3, le=255)]
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


@dataclass(frozen=True)
class Span:
    """Bytes ``[at, at + length)`` of an object are at ``addr`` of the peer's memory
    ``(dev, mem)``."""

    at: int
    addr: int
    length: int
    dev: int
    mem: str


def md_agent(metadata: bytes) -> str | None:
    """The agent name a NIXL metadata blob starts with (``nixlSerDes|Agent<len>name|``)."""
    head = b"nixlSerDes|Agent"
    start = len(head) + 8
    if not metadata.startswith(head) or len(metadata) < start:
        return None
    n = int.from_bytes(metadata[len(head) : start], sys.byteorder)
    if not 0 < n <= 1024 or metadata[start + n : start + n + 1] != b"|":
        return None
    try:
        return metadata[start : start + n].decode()
    except UnicodeDecodeError:
        return None


def decode_hello(peer: PeerInfo) -> LandingHello:
    """Decode a peer's Hello info.

    Raises:
        BackendError: it is malformed or too large, or lends a landing that is not
            host memory inside the address space.
    """
    where = f"nixl hello info from {peer.name!r}"
    if len(peer.info) > 2 * MAX_METADATA:
        raise BackendError(f"{where} is too large")
    hello = decode_blob(_landing_hello_decoder, peer.info, where)
    if len(hello.metadata) > MAX_METADATA:
        raise BackendError(f"{where} is too large")
    landing = hello.landing
    if landing is not None and (
        landing.region.mem != "DRAM"
        or not landing.region.length
        or landing.region.addr + landing.region.length > U64_MAX
        or len(landing.metadata) > MAX_METADATA
    ):
        raise BackendError(f"{where} lends a landing that is not host memory of its own")
    return hello


def landed_range(
    data: bytes, token: int, size: int, nbytes: int, peer: str
) -> tuple[int, int] | None:
    """Where the bytes of a landed reference from ``peer`` are in the landing lent to it
    (``token``, ``size`` bytes; 0: none lent): ``(offset, length)``; None for a
    reference of another form.

    Raises:
        BackendError: malformed, another landing's token, a range outside the landing.
    """
    where = f"nixl reference from {peer!r}"
    ref = decode_blob(_landed_ref_decoder, data, where)
    if ref.pool != LANDED:
        return None
    if ref.length != nbytes:
        raise BackendError(f"{where} has length {ref.length} != {nbytes}")
    if not token or ref.landing != token:
        raise BackendError(f"{where} names landing {ref.landing}, not the one lent to it")
    if ref.region is not None or ref.metadata or ref.lent or ref.pieces:
        raise BackendError(f"{where} mixes its landing with a region or pieces")
    if ref.offset + ref.length > size:
        raise BackendError(
            f"{where} spans [{ref.offset}, {ref.offset + ref.length}) outside its "
            f"{size}-byte landing"
        )
    return ref.offset, ref.length


def resolve(
    data: bytes, pools: list[Region], nbytes: int, peer: str
) -> tuple[list[Span], list[Lent]]:
    """Decode and check a reference from ``peer`` (whose pools are ``pools``) to an
    object of ``nbytes``. Returns where its bytes are, and the registrations of the
    peer (region and metadata) to make known to the agent first.

    Raises:
        BackendError: malformed, or names memory outside what the peer owns.
    """
    where = f"nixl reference from {peer!r}"
    ref = decode_blob(_pieces_ref_decoder, data, where)
    if ref.length != nbytes:
        raise BackendError(f"{where} has length {ref.length} != {nbytes}")

    def check_region(region: Region, metadata: bytes) -> None:
        if region.addr + region.length > U64_MAX:
            raise BackendError(f"{where} names a region past the address space")
        if any(region.overlaps(p) for p in pools):
            raise BackendError(f"{where} names a region inside its own pool")
        if len(metadata) > MAX_METADATA:
            raise BackendError(f"{where} carries too much metadata")

    if ref.pool == PIECES:
        if ref.region is not None or ref.metadata or ref.offset or not ref.pieces:
            raise BackendError(f"{where} mixes pieces with a pool or a region")
        if len(ref.lent) > len(ref.pieces):
            raise BackendError(f"{where} has {len(ref.pieces)} pieces, {len(ref.lent)} regions")
        for entry in ref.lent:
            check_region(entry.region, entry.metadata)
        check_pieces([(p.at, p.length) for p in ref.pieces], nbytes, where)
        spans = []
        for p in ref.pieces:
            if p.lent >= len(ref.lent):
                raise BackendError(f"{where}: a piece names region {p.lent} of {len(ref.lent)}")
            r = ref.lent[p.lent].region
            if not r.addr <= p.addr or p.addr + p.length > r.addr + r.length:
                raise BackendError(f"{where} has a piece outside its region")
            spans.append(Span(p.at, p.addr, p.length, r.dev, r.mem))
        return spans, list(ref.lent)
    if ref.lent or ref.pieces:
        raise BackendError(f"{where} has pieces but names pool {ref.pool}")
    loads: list[Lent] = []
    if ref.pool >= 0:
        if ref.region is not None or ref.metadata:
            raise BackendError(f"{where} mixes pool and region")
        if ref.pool >= len(pools):
            raise BackendError(f"{where} names pool {ref.pool}; it announced {len(pools)}")
        region = pools[ref.pool]
    elif ref.pool == DEDICATED:
        if ref.region is None:
            raise BackendError(f"{where} names no region")
        region = ref.region
        check_region(region, ref.metadata)
        loads.append(Lent(region, ref.metadata))
    else:
        raise BackendError(f"{where} names pool {ref.pool}")
    if ref.offset + ref.length > region.length or region.addr + region.length > U64_MAX:
        raise BackendError(
            f"{where} spans [{ref.offset}, {ref.offset + ref.length}) outside its "
            f"{region.mem} region of {region.length} bytes"
        )
    return [Span(0, region.addr + ref.offset, nbytes, region.dev, region.mem)], loads
