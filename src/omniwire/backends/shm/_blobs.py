"""The shm backend's Hello info and references (spec §9.2) as msgspec structs, and
their codecs."""

from __future__ import annotations

import msgspec


class _HelloInfo(msgspec.Struct, frozen=True):
    """The Hello info of 1.1 (what a reader that does not read forwards writes)."""

    prefix: str


class _Hello(_HelloInfo, frozen=True):
    """The Hello info as omniwire writes it: ``forwards`` last (default false)."""

    forwards: bool = False


class _Ref(msgspec.Struct, frozen=True):
    segment: str
    offset: int
    size: int
    dedicated: bool = False


class _ForwardRef(_Ref, frozen=True):
    """A reference with ``origin`` (a forward's), or read with it defaulting to ``""``."""

    origin: str = ""


_hello_decoder = msgspec.msgpack.Decoder(_HelloInfo)  # the 1.1 forms (vectors)
_ref_decoder = msgspec.msgpack.Decoder(_Ref)
_forwards_hello_decoder = msgspec.msgpack.Decoder(_Hello)  # what a reader reads
_forward_ref_decoder = msgspec.msgpack.Decoder(_ForwardRef)
_encoder = msgspec.msgpack.Encoder()
