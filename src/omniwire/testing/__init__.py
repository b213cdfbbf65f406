"""Test support for omniwire and for third-party backends.

- :class:`BackendConformance` — subclass it to run the conformance suite on a backend.
- :class:`MockBackend`, :class:`MockHooks`, :func:`register_mock_backend` — an
  in-process transport whose calls a test can pause or fail, for tests of the
  endpoint's byte path.
- :mod:`omniwire.testing.strategies` — Hypothesis strategies for payloads.
- :class:`PeerProcess` — runs ``python -m omniwire.peer`` (echo or sink) as a child process.

Needs the ``test`` extra (pytest, hypothesis).
"""

from .conformance import BackendConformance, PeerProcess, require_backend
from .mock import MockBackend, MockCall, MockGate, MockHooks, register_mock_backend

__all__ = [
    "BackendConformance",
    "MockBackend",
    "MockCall",
    "MockGate",
    "MockHooks",
    "PeerProcess",
    "register_mock_backend",
    "require_backend",
]
