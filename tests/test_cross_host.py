"""Two endpoints set up as two hosts (different host identities, tcp:// on 127.0.0.1):
cross-host routing picks mooncake by default, nixl or nccl when a policy or a route
says so, and Hypothesis payloads round-trip bit-exactly through each."""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Iterator
from typing import Any

import anyio
import pytest
import torch
from anyio.from_thread import start_blocking_portal
from hypothesis import HealthCheck, given, settings

from omniwire.endpoint import Endpoint
from omniwire.routing import PreferenceOrderPolicy
from omniwire.testing import PeerProcess, require_backend
from omniwire.testing.strategies import assert_payload_equal, payloads

ENGINES = ("mooncake", "nixl", "nccl")
REMOTE_HOST = "test-remote-host"
os.environ.setdefault("UCX_NET_DEVICES", "lo")


@pytest.fixture(scope="module")
def remote() -> Iterator[tuple[PeerProcess, str]]:
    for engine in ENGINES:
        require_backend(engine)
    tag = secrets.token_hex(3)
    routes = {f"src-nixl-{tag}": "nixl", f"src-nccl-{tag}": "nccl"}  # the way back
    peer = PeerProcess(
        f"remote-{tag}",
        "tcp://127.0.0.1:0",
        "--host-id",
        REMOTE_HOST,
        "--backends",
        "local,shm,mooncake,nixl,nccl",
        "--routes",
        json.dumps(routes),
        "--policy",
        "default",
    )
    yield peer, tag
    assert peer.stop() == 0


@pytest.mark.parametrize(
    ("name", "expected", "how"),
    [
        ("default", "mooncake", {}),
        ("nixl", "nixl", {"policy": PreferenceOrderPolicy(["nixl"])}),
        ("nccl", "nccl", {"routes": "nccl"}),
    ],
)
def test_cross_host_routes_and_round_trips(
    remote: tuple[PeerProcess, str], name: str, expected: str, how: dict[str, Any]
) -> None:
    peer, tag = remote
    ep = _source(f"src-{name}-{tag}", peer, how)
    with start_blocking_portal() as portal, portal.wrap_async_context_manager(ep):
        portal.call(ep.wait_peer, peer.name, 60)
        route = portal.call(lambda: _route(ep, peer.name))
        assert route.backend == expected, route.explain()
        assert route.reason.startswith("another host")
        if name == "default":
            assert dict(route.rejected)["shm"].startswith("reaches same process, same host")
            assert dict(route.rejected)["nccl"].startswith("opt-in only")
        counter = iter(range(10**6))

        @settings(
            max_examples=6,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
        @given(payloads(max_leaves=6))
        def round_trip(value: Any) -> None:
            # an anchor of 64 KiB: small payloads would travel inline, not over the engine
            sent = {"v": value, "anchor": torch.arange(1 << 14, dtype=torch.float32)}
            d = portal.call(_echo, ep, peer.name, sent, f"x{next(counter)}")
            assert d.kind == "payload"
            assert d.backend == expected
            assert_payload_equal(sent, d.payload)

        round_trip()


def _source(name: str, peer: PeerProcess, how: dict[str, Any]) -> Endpoint:
    """The sending endpoint, routed to ``peer`` by ``how`` ({"policy": ...} or
    {"routes": BACKEND}; {}: the default policy)."""
    kw: dict[str, Any] = {}
    if "policy" in how:
        kw["policy"] = how["policy"]
    if "routes" in how:
        kw["routes"] = {peer.name: how["routes"]}
    return Endpoint(
        name,
        address="tcp://127.0.0.1:0",
        peers={peer.name: peer.address},
        backends=["local", "shm", *ENGINES],
        ack_timeout=60,
        **kw,
    )


async def _route(ep: Endpoint, peer: str) -> Any:
    return ep.route(peer, {"t": torch.ones(1 << 16)})


async def _echo(ep: Endpoint, peer: str, value: Any, rid: str) -> Any:
    with anyio.fail_after(60):
        receipt = await ep.send(peer, value, request_id=rid)
        d = await ep.receive()
        await receipt.wait()
        return d


@pytest.mark.parametrize(
    ("engine", "how"),
    [
        ("mooncake", {}),
        ("nixl", {"policy": PreferenceOrderPolicy(["nixl"])}),
        ("nccl", {"routes": "nccl"}),
    ],
)
def test_lent_conjugate_and_negated_views_arrive_as_their_values(
    remote: tuple[PeerProcess, str], engine: str, how: dict[str, Any]
) -> None:
    """A lazily conjugated (or negated) tensor lent to an engine: its memory holds
    other values than it reads as, so it is packed (resolved), not read in place; a
    zero tensor (torch's lazy zeros) has no memory to read at all."""
    peer, tag = remote
    ep = _source(f"src-{engine}-{tag}", peer, how)
    z = torch.complex(torch.arange(1 << 13, dtype=torch.float32), torch.ones(1 << 13))
    views = {
        "conj": z.conj(),  # contiguous, its memory holds the unconjugated values
        "neg": torch._neg_view(torch.arange(1 << 14, dtype=torch.float32)),
        "zero": torch._efficientzerotensor(1 << 14),  # no memory at all (data_ptr 0)
    }
    assert all(v.is_contiguous() for v in views.values())
    with start_blocking_portal() as portal, portal.wrap_async_context_manager(ep):
        portal.call(ep.wait_peer, peer.name, 60)
        for key, view in views.items():
            d = portal.call(_echo_lent, ep, peer.name, {key: view}, f"lent-{engine}-{key}")
            assert d.backend == engine
            assert torch.equal(d.payload[key], view.clone().resolve_conj().resolve_neg()), key


async def _echo_lent(ep: Endpoint, peer: str, value: Any, rid: str) -> Any:
    with anyio.fail_after(60):
        receipt = await ep.send(peer, value, request_id=rid, lend=True)
        d = await ep.receive()
        await receipt.wait()
        return d


@pytest.mark.parametrize(
    ("engine", "how"),
    [("mooncake", {}), ("nixl", {"policy": PreferenceOrderPolicy(["nixl"])})],
)
def test_a_tensor_born_in_an_engines_pool_is_sent_in_place_to_another_host(
    remote: tuple[PeerProcess, str], engine: str, how: dict[str, Any]
) -> None:
    """``Endpoint.empty()`` on a route through mooncake or nixl is a slot of the
    engine's registered pool (``Capabilities.shared_refs``): each send of it, refilled
    between sends, packs nothing and lends nothing, and the slot is freed on release."""
    peer, tag = remote
    ep = _source(f"src-{engine}-{tag}", peer, how)
    with start_blocking_portal() as portal, portal.wrap_async_context_manager(ep):
        portal.call(ep.wait_peer, peer.name, 60)
        portal.call(_born_round_trips, ep, peer.name, engine)


async def _born_round_trips(ep: Endpoint, peer: str, engine: str) -> None:
    backend = ep.backend(engine)
    buf = await ep.empty(peer, (1 << 16,), torch.float32)
    assert buf.backend == engine
    exports, packed = backend.stats().exports, ep.counters["bytes_packed"]
    lent = backend.counters["lent"]
    for i in range(3):
        want = torch.arange(1 << 16, dtype=torch.float32) * (i + 1)
        buf.tensor.copy_(want)
        d = await _echo(ep, peer, {"h": buf.tensor}, f"born-{engine}-{i}")
        assert d.backend == engine and torch.equal(d.payload["h"], want)
        d.release()
        await buf.settled(60)
    assert backend.stats().exports == exports  # no slot packed for the sends
    assert ep.counters["bytes_packed"] == packed
    assert backend.counters["lent"] == lent
    buf.release()
    assert backend.stats().exports == exports - 1
