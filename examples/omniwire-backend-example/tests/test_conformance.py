"""The plugin passes omniwire's public conformance suite, between two processes."""

from __future__ import annotations

from omniwire.testing import BackendConformance


class TestExampleTcp(BackendConformance):
    backend = "example_tcp"


class TestExampleTcpOverTcpControlNoPool(BackendConformance):
    """Control plane over tcp:// and no pool: every object gets a buffer of its own."""

    backend = "example_tcp"
    transport = "tcp"
    backend_options = {"example_tcp": {"pool_size": 0}}  # noqa: RUF012
    max_examples = 6
