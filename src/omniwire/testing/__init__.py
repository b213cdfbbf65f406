"""Test support for omniwire and for third-party backends.

- :class:`BackendConformance` — subclass it to run the conformance suite on a backend.
- :mod:`omniwire.testing.strategies` — Hypothesis strategies for payloads.
- :class:`PeerProcess` — runs ``python -m omniwire.peer`` (echo or sink) as a child process.

Needs the ``test`` extra (pytest, hypothesis).
"""

from .conformance import BackendConformance, PeerProcess, require_backend

__all__ = ["BackendConformance", "PeerProcess", "require_backend"]
