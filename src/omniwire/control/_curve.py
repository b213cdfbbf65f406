"""CURVE authentication: the key pair derived from a shared secret, and the ZAP
credentials provider that lets in only clients presenting it."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import zmq
from zmq.utils import z85


@dataclass(frozen=True)
class CurveKey:
    """A CURVE key pair derived from a shared secret (any string or bytes)."""

    public: bytes
    secret: bytes

    @classmethod
    def from_shared_secret(cls, secret: str | bytes) -> CurveKey:
        raw = secret.encode() if isinstance(secret, str) else secret
        if not raw:
            raise ValueError("the shared authentication key is empty")
        secret_z85 = z85.encode(hashlib.sha256(b"omniwire-curve-v1\0" + raw).digest())
        return cls(public=zmq.curve_public(secret_z85), secret=secret_z85)


class AllowOne:
    """ZAP credentials provider: accept exactly one client public key."""

    def __init__(self, public: bytes) -> None:
        self.public = public

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self.public
