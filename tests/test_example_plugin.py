"""The third-party backend in examples/omniwire-backend-example, installed as a package.

It is found through its ``omniwire.backends`` entry point, routed only when a
policy asks for it (the default policy prefers shm and says why), carries
Hypothesis payloads bit-exactly between two processes, and passes the public
conformance suite. Without the plugin installed these tests skip, or fail under
``OMNIWIRE_REQUIRE_ENGINES=1`` (as in ``make test`` and CI).
"""

from __future__ import annotations

import itertools
import json
import os
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import anyio
import pytest
import torch
from anyio.from_thread import BlockingPortal, start_blocking_portal
from hypothesis import HealthCheck, given, settings

from omniwire import registry
from omniwire.backends.base import BackendContext, Locality, PeerInfo
from omniwire.delivery import Delivery
from omniwire.endpoint import Endpoint
from omniwire.errors import BackendError
from omniwire.routing import PreferenceOrderPolicy
from omniwire.testing import BackendConformance, PeerProcess, require_backend
from omniwire.testing.conformance import ipc_address
from omniwire.testing.strategies import assert_payload_equal, payloads

PLUGIN = "example_tcp"
DIST = "omniwire-backend-example"
INSTALL = "pip install -e examples/omniwire-backend-example"


def plugin_class() -> type[Any]:
    """The plugin's backend class; skip without it (fail under OMNIWIRE_REQUIRE_ENGINES=1)."""
    if PLUGIN not in registry.backends():
        reason = (
            f"backend {PLUGIN!r} is not registered: the example plugin is not installed ({INSTALL})"
        )
        if os.environ.get("OMNIWIRE_REQUIRE_ENGINES") == "1":
            pytest.fail(reason + " (OMNIWIRE_REQUIRE_ENGINES=1: it must be)")
        pytest.skip(reason)
    return require_backend(PLUGIN)


def test_discovered_through_its_entry_point() -> None:
    cls = plugin_class()
    entry = registry.backend_status(PLUGIN)
    assert entry.status == "available", entry.error
    assert entry.source.startswith(f"plugin {DIST} "), entry.source
    assert entry.entry_point is not None
    assert entry.entry_point.group == registry.BACKEND_GROUP
    assert entry.entry_point.value == "omniwire_backend_example:TcpBackend"
    assert entry.cls is cls
    assert cls.name == PLUGIN
    assert cls.auto_start == "tcp"
    assert cls.summary
    assert cls.install_hint
    caps = cls.capabilities
    assert caps.devices == {"cpu"}
    assert caps.localities == {Locality.SAME_HOST, Locality.CROSS_HOST}
    assert caps.progressive
    # Lower than the built-ins: it wins only when chosen or when nothing else fits.
    for builtin in ("shm", "local"):
        assert registry.load_backend(builtin).capabilities.preference > caps.preference


# -- an edge between this process and a peer process -------------------------------------


@dataclass
class _Edge:
    portal: BlockingPortal
    preferring: Endpoint  # PreferenceOrderPolicy([example_tcp])
    default: Endpoint  # DefaultPolicy
    peer: str


@pytest.fixture(scope="module")
def edge() -> Iterator[_Edge]:
    plugin_class()
    tag = secrets.token_hex(3)
    me, other, far = f"pref-{tag}", f"dflt-{tag}", f"far-{tag}"
    with start_blocking_portal() as portal:
        peer = PeerProcess(
            far,
            ipc_address(far),
            "--backends",
            f"{PLUGIN},shm",
            "--routes",
            json.dumps({me: PLUGIN}),
            "--zero-copy",  # the peer fetches into the backend's own buffers
        )
        try:
            preferring = Endpoint(
                me,
                address=ipc_address(me),
                peers={far: peer.address},
                backends=[PLUGIN, "shm"],
                policy=PreferenceOrderPolicy([PLUGIN]),
            )
            default = Endpoint(
                other,
                address=ipc_address(other),
                peers={far: peer.address},
                backends=[PLUGIN, "shm"],
            )
            with (
                portal.wrap_async_context_manager(preferring),
                portal.wrap_async_context_manager(default),
            ):
                portal.call(preferring.wait_peer, far, 30.0)
                portal.call(default.wait_peer, far, 30.0)
                yield _Edge(portal, preferring, default, far)
        finally:
            code = peer.stop()
            assert code == 0, f"peer process exited with {code}: {peer.output}"


def test_preference_order_policy_routes_the_edge_over_it(edge: _Edge) -> None:
    payload = {"t": torch.ones(1000)}
    route = edge.portal.call(edge.preferring.route, edge.peer, payload)
    assert route.backend == PLUGIN, route.explain()
    assert route.policy == f"preference({PLUGIN})"
    chunk = edge.portal.call(edge.preferring.route, edge.peer, payload, "stream_chunk")
    assert chunk.backend == PLUGIN, chunk.explain()


def test_default_policy_prefers_shm_and_says_why(edge: _Edge) -> None:
    payload = {"t": torch.ones(1 << 14)}  # 64 KiB: too large to travel inline
    route = edge.portal.call(edge.default.route, edge.peer, payload)
    assert route.backend == "shm", route.explain()
    ours = plugin_class().capabilities.preference
    shm = registry.load_backend("shm").capabilities.preference
    assert dict(route.rejected)[PLUGIN] == f"fits, but preference {ours} < {shm}", route.explain()


async def _round_trip(ep: Endpoint, peer: str, value: Any, request_id: str) -> Delivery:
    with anyio.fail_after(30):
        receipt = await ep.send(peer, value, request_id=request_id)
        assert receipt.backend == PLUGIN
        await receipt.wait()  # raises at once if the peer could not take it
        return await ep.receive()


def test_payloads_go_end_to_end_over_it(edge: _Edge) -> None:
    counter = itertools.count()

    @settings(
        max_examples=10,
        deadline=None,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.function_scoped_fixture,
        ],
    )
    @given(payloads(max_leaves=6))
    def check(value: Any) -> None:
        rid = f"plugin-{next(counter)}"
        d = edge.portal.call(_round_trip, edge.preferring, edge.peer, value, rid)
        assert d.kind == "payload", d
        assert d.request_id == rid
        assert d.backend == PLUGIN
        assert_payload_equal(value, d.payload)

    check()


def test_a_large_payload_arrives_progressively_and_whole(edge: _Edge) -> None:
    big = torch.randint(0, 256, (12 << 20,), dtype=torch.uint8)  # > one progressive chunk
    value = {"big": big, "f": torch.randn(3, 5, dtype=torch.float64)}
    d = edge.portal.call(_round_trip, edge.preferring, edge.peer, value, "plugin-large")
    assert d.backend == PLUGIN
    assert_payload_equal(value, d.payload)


def test_unknown_objects_are_backend_errors_not_crashes() -> None:
    cls = plugin_class()

    async def run() -> None:
        a, b = cls(BackendContext("a", 1)), cls(BackendContext("b", 2))
        await a.start()
        await b.start()
        try:
            to_a = PeerInfo("a", 1, os.getpid(), "h", "t", Locality.SAME_HOST, a.hello())
            to_b = PeerInfo("b", 2, os.getpid(), "h", "t", Locality.SAME_HOST, b.hello())
            await a.connect(to_b)
            await b.connect(to_a)
            out = await a.export(to_b, 64, "cpu")
            assert out.buffer is not None
            out.buffer.fill_(7)
            await out.publish(0, 64)
            imp = await b.import_(to_a, out.ref, 64)
            dest = torch.zeros(64, dtype=torch.uint8)
            await imp.fetch(0, 32, dest)
            out.release()  # released by the sender: the reference now names nothing
            with pytest.raises(BackendError, match="unknown"):
                await imp.fetch(32, 64, dest)
            imp.close()
            # the sender is still serving, over the same connection
            again = await a.export(to_b, 16, "cpu")
            assert again.buffer is not None
            again.buffer.fill_(9)
            await again.publish(0, 16)
            imp = await b.import_(to_a, again.ref, 16)
            await imp.fetch(0, 16, dest)
            assert torch.equal(dest[:16], torch.full((16,), 9, dtype=torch.uint8))
            assert torch.equal(dest[16:32], torch.full((16,), 7, dtype=torch.uint8))
            imp.close()
            again.release()
            assert a.stats().idle and b.stats().idle
        finally:
            await b.aclose()
            await a.aclose()

    anyio.run(run)


class TestExampleTcpConformance(BackendConformance):
    """The public conformance suite, run from the main test tree so CI runs it."""

    backend = PLUGIN

    @pytest.fixture(scope="class")
    @classmethod
    def backend_class(cls) -> type[Any]:
        return plugin_class()
