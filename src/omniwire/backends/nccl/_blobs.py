"""nccl's wire blobs: its Hello info and its references, typed and validated.

Hello info (``BackendInfo.info``): msgpack ``{"host": str, "port": u16, "cuda": bool,
"pieces": bool}`` — where its rendezvous store listens, whether it can run NCCL,
and (default false) whether it reads references with pieces.

Reference (``BackendRef.info``): msgpack ``{"gen": u32, "tag": u31, "nbytes": u64,
"device": "cpu"|"cuda", "ordered": bool}``, plus ``"pieces": [[at, length], ...]``
for lent tensors (sent only to a peer whose Hello says ``pieces``; tagged channel,
CPU objects only): the object travels as one gloo message per piece, piece ``i``
under tag ``tag + i``, and its bytes belong at ``[at, at + length)`` of the
object. Pieces are sorted by ``at``, do not overlap, have ``length > 0`` and lie
inside the object; bytes between pieces are padding (unspecified). Without
pieces the object is one message under ``tag``.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from ...errors import BackendError
from ..base import PeerInfo
from ..support import check_pieces, decode_blob

__all__ = [
    "MAX_TAG",
    "HelloInfo",
    "PiecesHello",
    "PiecesRef",
    "Ref",
    "decode_hello",
    "decode_ref",
    "encode",
]

MAX_TAG = 2**31 - 1  # gloo tags are non-negative int32; 0 is the ordered channel's
Device = Literal["cpu", "cuda"]


class HelloInfo(msgspec.Struct, frozen=True):
    """The Hello info as wire 1.1 documents it (specs/wire-v1.md §9)."""

    host: str
    port: int
    cuda: bool = False


class PiecesHello(HelloInfo, frozen=True):
    """What this backend announces and reads: the 1.1 fields and ``pieces``."""

    pieces: bool = False


class Ref(msgspec.Struct, frozen=True):
    gen: int
    tag: int
    nbytes: int
    device: Device
    ordered: bool


class PiecesRef(Ref, frozen=True):
    """Any reference (what is decoded); a lent one is encoded with its pieces."""

    pieces: list[tuple[int, int]] = msgspec.field(default_factory=list)


# _hello_decoder and _ref_decoder read the documented 1.1 forms (the blob vectors);
# the backend reads every form with the others.
_hello_decoder = msgspec.msgpack.Decoder(HelloInfo)
_ref_decoder = msgspec.msgpack.Decoder(Ref)
_pieces_hello_decoder = msgspec.msgpack.Decoder(PiecesHello)
_pieces_ref_decoder = msgspec.msgpack.Decoder(PiecesRef)
encode = msgspec.msgpack.Encoder().encode


def decode_hello(peer: PeerInfo) -> PiecesHello:
    """Raises BackendError: malformed, or names no usable store."""
    hello = decode_blob(_pieces_hello_decoder, peer.info, f"nccl hello info from {peer.name!r}")
    if not hello.host or len(hello.host) > 255 or not 0 < hello.port < 65536:
        raise BackendError(
            f"nccl hello info from {peer.name!r} names no usable store "
            f"({hello.host[:80]!r}:{hello.port})"
        )
    return hello


def decode_ref(data: bytes, nbytes: int, peer: str, cuda_pair: bool) -> PiecesRef:
    """Decode and check a reference from ``peer`` to an object of ``nbytes``;
    ``cuda_pair``: NCCL connects this pair.

    Raises:
        BackendError: malformed or inconsistent.
    """
    where = f"nccl reference from {peer!r}"
    ref = decode_blob(_pieces_ref_decoder, data, where)
    if ref.nbytes != nbytes or nbytes < 0:
        raise BackendError(f"{where} has size {ref.nbytes} != {nbytes}")
    last = ref.tag + max(len(ref.pieces), 1) - 1
    if not 0 < ref.tag <= last < MAX_TAG or ref.gen < 0:
        raise BackendError(f"{where} has tag {ref.tag} / generation {ref.gen}")
    if ref.device == "cuda" and not (ref.ordered and cuda_pair):
        raise BackendError(f"{where} names a CUDA object, but NCCL does not connect this pair")
    if ref.pieces:
        if ref.ordered or ref.device != "cpu":
            raise BackendError(f"{where} has pieces on the ordered channel or off the CPU")
        check_pieces(ref.pieces, nbytes, where)
    return ref
