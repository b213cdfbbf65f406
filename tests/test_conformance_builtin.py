"""The built-in same-host backends run the public conformance suite."""

from __future__ import annotations

from omniwire.testing import BackendConformance


class TestShm(BackendConformance):
    backend = "shm"


class TestLocal(BackendConformance):
    backend = "local"
    two_process = False
