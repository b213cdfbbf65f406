"""Routing policies: pure functions of (edge, payload info, candidates)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from omniwire.backends.base import Capabilities, Locality
from omniwire.backends.local import LocalBackend
from omniwire.backends.shm import ShmBackend
from omniwire.errors import NoRouteError
from omniwire.routing import (
    INLINE,
    Candidate,
    DefaultPolicy,
    Edge,
    PayloadInfo,
    PreferenceOrderPolicy,
    Route,
    RoutingPolicy,
    StaticTablePolicy,
    StrictDefaultPolicy,
)

LOCAL = Candidate("local", LocalBackend.capabilities, LocalBackend.summary)
SHM = Candidate("shm", ShmBackend.capabilities, ShmBackend.summary)
CROSS = frozenset({Locality.SAME_HOST, Locality.CROSS_HOST})
MOONCAKE = Candidate("mooncake", Capabilities(localities=CROSS, progressive=True, preference=60))
NIXL = Candidate("nixl", Capabilities(localities=CROSS, progressive=True, preference=50))
NCCL = Candidate(
    "nccl",
    Capabilities(
        devices=frozenset({"cpu", "cuda"}),
        localities=CROSS,
        opt_in="needs a process group",
        preference=40,
    ),
)
CUDA_IPC = Candidate(
    "cuda_ipc",
    Capabilities(
        devices=frozenset({"cuda"}),
        localities=frozenset({Locality.SAME_HOST}),
        host_staging=False,
        needs_gpu_peer_access=True,
        preference=85,
    ),
)
PLUGIN = Candidate("example_tcp", Capabilities(localities=CROSS, preference=10))
ALL = (INLINE, LOCAL, SHM, MOONCAKE, NIXL, NCCL, CUDA_IPC, PLUGIN)


def edge(locality: Locality, *, gpu: bool = False, peer_access: bool = False) -> Edge:
    devices = frozenset({"cpu", "cuda"}) if gpu else frozenset({"cpu"})
    return Edge("src", "dst", locality, devices, devices, peer_access)


def info(
    kind: str = "payload", nbytes: int = 1 << 20, devices: tuple[str, ...] = ("cpu",)
) -> PayloadInfo:
    return PayloadInfo(kind, nbytes, frozenset(devices), 1)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("e", "p", "expected"),
    [
        (edge(Locality.SAME_PROCESS), info(), "local"),
        (edge(Locality.SAME_PROCESS), info("stream_chunk", 64), "local"),
        (edge(Locality.SAME_HOST), info("stream_chunk", 64), "inline"),
        (edge(Locality.SAME_HOST), info("stream_chunk", 16 << 10), "inline"),
        (edge(Locality.SAME_HOST), info("stream_chunk", (16 << 10) + 1), "shm"),
        (edge(Locality.SAME_HOST), info("stream_chunk", 4 << 20), "shm"),
        (edge(Locality.SAME_HOST), info("payload", 64), "shm"),
        (edge(Locality.SAME_HOST, gpu=True, peer_access=True), info(devices=("cuda",)), "cuda_ipc"),
        (edge(Locality.CROSS_HOST), info(), "mooncake"),
        (edge(Locality.CROSS_HOST), info("stream_chunk", 100), "inline"),
    ],
)
def test_default_policy_reproduces_the_expected_routes(
    e: Edge, p: PayloadInfo, expected: str
) -> None:
    route = DefaultPolicy().select(e, p, ALL)
    assert route.backend == expected, route.explain()
    assert route.reason
    assert {name for name, _ in route.rejected} == {c.name for c in ALL} - {expected}


def test_cross_host_without_mooncake_uses_nixl() -> None:
    route = DefaultPolicy().select(edge(Locality.CROSS_HOST), info(), (INLINE, SHM, NIXL, PLUGIN))
    assert route.backend == "nixl"
    assert dict(route.rejected)["shm"].startswith("reaches same process, same host")


def test_a_cpu_stream_chunk_of_any_size_to_a_cpu_stage_has_a_route() -> None:
    for nbytes in (0, 1, 16 << 10, (16 << 10) + 1, 1 << 30):
        route = DefaultPolicy().select(
            edge(Locality.SAME_HOST), info("stream_chunk", nbytes), (INLINE, SHM)
        )
        assert route.backend in ("inline", "shm")


def test_gpu_fallback_is_recorded_and_strict_mode_raises() -> None:
    e = edge(Locality.SAME_HOST, gpu=True, peer_access=False)
    route = DefaultPolicy().select(e, info(devices=("cuda",)), (INLINE, SHM, CUDA_IPC))
    assert route.backend == "shm"
    assert route.fallback
    assert "staged through host memory" in route.reason
    assert "cannot access each other" in dict(route.rejected)["cuda_ipc"]
    with pytest.raises(NoRouteError, match="cuda_ipc: the GPUs") as exc:
        StrictDefaultPolicy().select(e, info(devices=("cuda",)), (INLINE, SHM, CUDA_IPC))
    assert ("shm", "would stage tensors through host memory") in exc.value.rejected


def test_opt_in_backends_need_configuration() -> None:
    e = edge(Locality.CROSS_HOST)
    assert DefaultPolicy().select(e, info(), (INLINE, NCCL, PLUGIN)).backend == "example_tcp"
    with pytest.raises(NoRouteError, match="opt-in only"):
        DefaultPolicy().select(e, info(), (INLINE, NCCL))
    assert StaticTablePolicy({"dst": "nccl"}).select(e, info(), (INLINE, NCCL)).backend == "nccl"
    assert PreferenceOrderPolicy(["nccl"]).select(e, info(), (INLINE, NCCL)).backend == "nccl"


def test_preference_order_policy_and_its_strict_mode() -> None:
    e = edge(Locality.SAME_HOST)
    route = PreferenceOrderPolicy(["example_tcp", "shm"]).select(e, info(), ALL)
    assert route.backend == "example_tcp"
    assert "first fit in preference order" in route.reason
    route = PreferenceOrderPolicy(["mooncake"]).select(edge(Locality.SAME_PROCESS), info(), ALL)
    assert route.backend == "local"  # mooncake does not reach a same-process peer
    assert "none of the preferred fit" in route.reason
    with pytest.raises(NoRouteError, match="mooncake: reaches"):
        PreferenceOrderPolicy(["mooncake"], strict=True).select(
            edge(Locality.SAME_PROCESS), info(), ALL
        )


def test_static_table_keys_and_errors() -> None:
    table = StaticTablePolicy({"src->dst:stream_chunk": "shm", "dst": "nixl"})
    e = edge(Locality.SAME_HOST)
    assert table.select(e, info("stream_chunk", 10), ALL).backend == "shm"
    assert table.select(e, info("payload"), ALL).backend == "nixl"
    assert table.select(Edge("src", "other", Locality.SAME_HOST), info(), ALL).backend == "shm"
    with pytest.raises(NoRouteError, match="not run by both"):
        StaticTablePolicy({"dst": "nixl"}).select(e, info(), (INLINE, SHM))
    with pytest.raises(NoRouteError, match="reaches"):
        StaticTablePolicy({"dst": "shm"}).select(edge(Locality.CROSS_HOST), info(), ALL)


def test_policies_implement_the_protocol() -> None:
    for policy in (
        DefaultPolicy(),
        StrictDefaultPolicy(),
        PreferenceOrderPolicy(["shm"]),
        StaticTablePolicy({}),
    ):
        assert isinstance(policy, RoutingPolicy)
        assert policy.name


localities = st.sampled_from(list(Locality))
kinds = st.sampled_from(["payload", "stream_chunk"])
device_sets = st.sets(st.sampled_from(["cpu", "cuda"]), max_size=2).map(frozenset)


@given(
    localities,
    kinds,
    st.integers(0, 1 << 32),
    device_sets,
    st.booleans(),
    st.booleans(),
    st.lists(st.sampled_from(ALL), unique_by=lambda c: c.name),
)
def test_routing_is_pure_and_never_picks_a_candidate_it_was_not_given(
    locality: Locality,
    kind: str,
    nbytes: int,
    devices: frozenset[str],
    gpu: bool,
    peer_access: bool,
    candidates: list[Candidate],
) -> None:
    e = edge(locality, gpu=gpu, peer_access=peer_access)
    p = PayloadInfo(kind, nbytes, devices, 1)  # type: ignore[arg-type]
    for policy in (DefaultPolicy(), StrictDefaultPolicy()):
        try:
            route = policy.select(e, p, candidates)
        except NoRouteError as exc:
            assert {name for name, _ in exc.rejected} <= {c.name for c in candidates}
            continue
        assert isinstance(route, Route)
        assert route.backend in {c.name for c in candidates}
        assert policy.select(e, p, candidates) == route  # deterministic
        if isinstance(policy, StrictDefaultPolicy):
            assert not route.fallback


@given(localities, st.integers(0, 1 << 32))
def test_default_policy_is_total_for_cpu_edges(locality: Locality, nbytes: int) -> None:
    """With the built-in CPU transports of that locality present, every CPU edge has a route."""
    e = edge(locality)
    for kind in ("payload", "stream_chunk"):
        route = DefaultPolicy().select(e, info(kind, nbytes), (INLINE, LOCAL, SHM, MOONCAKE))
        assert route.backend in ("inline", "local", "shm", "mooncake")


_LIMITS = st.lists(st.integers(0, 1 << 24), max_size=4)
_POLICIES = [
    DefaultPolicy(),
    StrictDefaultPolicy(),
    PreferenceOrderPolicy(["inline", "mooncake", "shm"]),
    StaticTablePolicy({"dst:payload": "local"}),
]


@given(
    limits=_LIMITS,
    kind=st.sampled_from(["payload", "stream_chunk"]),
    locality=st.sampled_from(list(Locality)),
    nbytes=st.integers(0, 1 << 25),
    pick=st.floats(0, 1),
    policy=st.sampled_from(_POLICIES),
)
def test_a_route_holds_for_every_size_of_its_class(
    limits: list[int],
    kind: str,
    locality: Locality,
    nbytes: int,
    pick: float,
    policy: RoutingPolicy,
) -> None:
    """A built-in policy's route names the sizes it holds for, and asking again for
    any size in them gives the very same route (reason and rejections included)."""
    from dataclasses import replace

    cands = [INLINE, LOCAL, SHM, MOONCAKE] + [
        Candidate(f"lim{i}", replace(PLUGIN.capabilities, max_nbytes=n))
        for i, n in enumerate(limits)
    ]
    e = edge(locality)
    try:
        route = policy.select(e, info(kind, nbytes), cands)
    except NoRouteError:
        return
    assert route.sizes is not None
    lo, hi = route.sizes
    assert lo <= nbytes <= hi
    other = lo + int(pick * (min(hi, 1 << 26) - lo))
    assert policy.select(e, info(kind, other), cands) == route


def test_the_route_cache_asks_a_sized_policy_once_per_class_and_others_once_per_size() -> None:
    """Chunks of 200 sizes on one edge: the default policy is asked once per size class
    (inline up to 16 KiB, shm beyond); a policy that gives no sizes, once per size."""
    from omniwire.routing import RouteCache

    class Counting:
        def __init__(self, inner: RoutingPolicy, sized: bool) -> None:
            self.inner, self.sized, self.calls, self.name = inner, sized, 0, "counting"

        def select(self, e: Edge, p: PayloadInfo, c: object) -> Route:
            self.calls += 1
            route = self.inner.select(e, p, c)  # type: ignore[arg-type]
            return route if self.sized else Route(route.backend, route.reason)

    e = edge(Locality.SAME_HOST)
    sizes = [64 * (i + 1) for i in range(100)] + [(1 << 20) + i for i in range(100)]
    for sized, expected in ((True, 2), (False, len(sizes))):
        policy, cache = Counting(DefaultPolicy(), sized), RouteCache()
        for n in sizes * 2:
            p = info("stream_chunk", n)
            route = cache.get(p)
            if route is None:
                route = policy.select(e, p, [INLINE, SHM])
                cache.put(p, route)
            assert route.backend == ("inline" if n <= 16 << 10 else "shm")
        assert policy.calls == expected


def test_a_class_route_explains_the_sizes_it_holds_for() -> None:
    small = DefaultPolicy().select(edge(Locality.SAME_HOST), info("stream_chunk", 100), ALL)
    big = DefaultPolicy().select(edge(Locality.SAME_HOST), info("stream_chunk", 1 << 20), ALL)
    assert small.sizes == (0, 16 << 10)
    assert small.reason.startswith("same host, stream chunk of at most 16.0 KiB with cpu")
    assert big.sizes is not None and big.sizes[0] == (16 << 10) + 1
    assert big.reason.startswith("same host, stream chunk of more than 16.0 KiB with cpu")
    assert ("inline", "carries at most 16.0 KiB") in big.rejected


@pytest.mark.parametrize("sizes", [(10, 5), (0, 50), "junk", (1,)], ids=str)
def test_a_route_whose_sizes_do_not_hold_its_own_payload_is_reused_for_that_shape_only(
    sizes: object,
) -> None:
    """A third-party policy's ``sizes`` that is malformed, or that does not contain the
    payload asked about, is not trusted for other sizes (and never raises)."""
    from omniwire.routing import RouteCache

    cache, route = RouteCache(), Route("shm", "why", sizes=sizes)  # type: ignore[arg-type]
    cache.put(info("stream_chunk", 100), route)
    assert cache.get(info("stream_chunk", 100)) is route
    assert cache.get(info("stream_chunk", 7)) is None
    assert cache.get(info("stream_chunk", 101)) is None
