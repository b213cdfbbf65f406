"""cuda_ipc: CUDA tensors between GPU stages of one host.

On a CPU machine these tests check everything but the CUDA calls themselves: the
backend reports itself unavailable with its reason; the slot allocator; the wire
blobs (encode, decode, validation); the routing rules; and the backend's whole
bookkeeping — both paths, quarantine, dedicated buffers, failures, timeouts, and
torch's IPC reference counters — driven through a fake of torch's CUDA IPC calls
that shares CPU storages inside this process. The GPU tests (the conformance suite
on CUDA tensors, same-GPU and cross-GPU two-process round trips) skip with their
reason, and fail instead under ``OMNIWIRE_GPU_CHECK=1`` (``scripts/gpu_check.sh``).
"""

from __future__ import annotations

import collections
import contextlib
import importlib.util
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import anyio
import msgspec
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omniwire import packing, registry
from omniwire.backends.base import (
    Availability,
    BackendContext,
    Capabilities,
    Export,
    Locality,
    PeerInfo,
)
from omniwire.backends.cuda_ipc import CudaApi, CudaIpcBackend, EventRing, TorchCuda
from omniwire.backends.cuda_ipc import _blobs as ci
from omniwire.backends.cuda_ipc._blobs import (
    build_views,
    decode_hello,
    decode_ref,
    packed_length,
    plan_shares,
)
from omniwire.backends.local import LocalBackend
from omniwire.backends.shm import ShmBackend
from omniwire.errors import BackendClosedError, BackendError, NoRouteError
from omniwire.routing import (
    INLINE,
    Candidate,
    DefaultPolicy,
    Edge,
    PayloadInfo,
    StaticTablePolicy,
    StrictDefaultPolicy,
)
from omniwire.testing import BackendConformance, require_backend
from omniwire.testing.strategies import assert_payload_equal, tensors
from omniwire.wire import DeviceInfo

ROOT = Path(__file__).resolve().parents[1]
AVAILABILITY = CudaIpcBackend.availability()
GPU_CHECK = os.environ.get("OMNIWIRE_GPU_CHECK") == "1"
PID = os.getpid()


def gpus() -> int:
    return torch.cuda.device_count() if AVAILABILITY.available else 0


def need_gpus(n: int = 1) -> None:
    """Skip (fail under OMNIWIRE_GPU_CHECK=1) without ``n`` GPUs."""
    if not AVAILABILITY.available:
        reason = f"cuda_ipc needs a GPU: {AVAILABILITY.reason}"
    elif gpus() < n:
        reason = f"needs {n} GPUs, {gpus()} visible"
    elif n > 1 and not torch.cuda.can_device_access_peer(0, 1):
        reason = "cuda:0 and cuda:1 cannot access each other"
    else:
        return
    if GPU_CHECK and n == 1:
        pytest.fail(reason + " (OMNIWIRE_GPU_CHECK=1)")
    pytest.skip(reason)


# =============================================================================== CPU


class TestWithoutCuda:
    def test_unavailable_with_its_reason(self) -> None:
        if AVAILABILITY.available:
            pytest.skip("CUDA is available here")
        assert "no CUDA device" in AVAILABILITY.reason
        entry = registry.backend_status("cuda_ipc")
        assert entry.status == "unavailable"
        assert "no CUDA device" in entry.error
        assert entry.cls is CudaIpcBackend

    def test_declared_as_the_issue_says(self) -> None:
        caps = CudaIpcBackend.capabilities
        assert caps.devices == frozenset({"cuda"})
        assert caps.localities == frozenset({Locality.SAME_HOST})
        assert not caps.host_staging
        assert caps.needs_gpu_peer_access and caps.zero_copy
        assert caps.preference == 85
        assert CudaIpcBackend.needs_gpu is True
        assert CudaIpcBackend.auto_start == "always"
        assert CudaIpcBackend.name == "cuda_ipc"

    def test_start_fails_clearly(self) -> None:
        if AVAILABILITY.available:
            pytest.skip("CUDA is available here")
        b = CudaIpcBackend(BackendContext("x", 1))
        with pytest.raises(BackendError, match="no CUDA device"):
            anyio.run(b.start)

    def test_cpu_endpoint_skips_it(self) -> None:
        if AVAILABILITY.available:
            pytest.skip("CUDA is available here")
        from omniwire import Endpoint

        async def run() -> list[str]:
            async with Endpoint("cpu-only-" + secrets.token_hex(2)) as ep:
                return ep.running_backends

        running = anyio.run(run)
        assert "cuda_ipc" not in running and "shm" in running

    def test_require_backend_skips_with_the_reason(self) -> None:
        if AVAILABILITY.available:
            pytest.skip("CUDA is available here")
        with pytest.raises(pytest.skip.Exception, match="no CUDA device"):
            require_backend("cuda_ipc")

    def test_bad_options(self) -> None:
        with pytest.raises(BackendError, match="power of two"):
            CudaIpcBackend(BackendContext("x", 1, {"min_block": 1000}))


# ----------------------------------------------------------------------- the event ring


def test_event_ring_reuses_events() -> None:
    made: list[int] = []

    def factory() -> tuple[Any, bytes]:
        made.append(1)
        return object(), bytes([len(made)]) * 64

    ring = EventRing(factory)
    i, e, h = ring.take()
    j, _, _ = ring.take()
    assert len(ring) == 2 and ring.in_use == 2 and i != j
    ring.give(i)
    k, e2, h2 = ring.take()
    assert (k, e2, h2) == (i, e, h)
    assert len(made) == 2


# ----------------------------------------------------------------------- the wire blobs


def _peer(pid: int = PID, info: bytes = b"", name: str = "a") -> PeerInfo:
    return PeerInfo(name, 1, pid, "h", "t", Locality.SAME_HOST, info)


def _share(storage: torch.UntypedStorage, n: int = 0, device: str = "GPU-A") -> ci.Share:
    if storage.nbytes() == 0:
        return ci.Share(device=device, handle=b"", nbytes=0, offset=0)
    return ci.Share(
        device=device,
        handle=b"H" + n.to_bytes(8, "little") + bytes(57),
        nbytes=storage.nbytes(),
        offset=0,
        counter=f"/torch_{PID}_12345_0",
        counter_offset=n,
        event=bytes(64),
        event_sync=True,
    )


def _sample_tensors() -> list[torch.Tensor]:
    base = torch.arange(48, dtype=torch.float32).reshape(6, 8)
    return [
        base[1:5, ::3],  # non-contiguous, offset into its storage
        base.t(),  # the same storage again
        torch.tensor(7, dtype=torch.int64),  # 0-dim
        torch.empty(0, 3, dtype=torch.float16),  # zero-size
        torch.tensor([True, False, True]),
        torch.arange(10, dtype=torch.uint8)[3:],
    ]


def _plan(ts: list[torch.Tensor]) -> tuple[ci.TensorsRef, dict[int, torch.UntypedStorage]]:
    counter = iter(range(1000))
    storages: dict[int, torch.UntypedStorage] = {}

    def share(s: torch.UntypedStorage) -> ci.Share:
        sh = _share(s, next(counter))
        storages[len(storages)] = s
        return sh

    return plan_shares(ts, share, lambda s: None), storages


class TestWireBlobs:
    def test_tensors_round_trip_and_rebuild_as_views(self) -> None:
        ts = _sample_tensors()
        ref, storages = _plan(ts)
        assert len(ref.shares) == 5  # base's storage is shared once for both views
        nbytes = packed_length(ts)
        assert nbytes == packing.plan(ts).nbytes
        decoded = decode_ref(ci.encode(ref), _peer(), nbytes)
        assert decoded == ref
        assert isinstance(decoded, ci.TensorsRef)
        views = build_views(decoded, [storages[i] for i in range(len(storages))])
        for t, v in zip(ts, views, strict=True):
            assert v.dtype == t.dtype and v.shape == t.shape and v.stride() == t.stride()
            assert torch.equal(v, t)
            if t.numel():
                assert v.data_ptr() == t.data_ptr()  # mapped in place: no copy

    @settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(st.lists(tensors(), min_size=1, max_size=6))
    def test_any_tensor_rebuilds_bit_exactly(self, ts: list[torch.Tensor]) -> None:
        """Any tensor whose memory holds its values (``export_tensors`` packs a lazily
        conjugated or negated one, or lazy zeros; :func:`plan_shares` refuses it)."""
        if not all(packing.holds_its_values(t) for t in ts):
            with pytest.raises(BackendError, match="conjugated or negated"):
                _plan(ts)
            ts = [packing.resolved(t) for t in ts]
        ref, storages = _plan(ts)
        decoded = decode_ref(ci.encode(ref), _peer(), packed_length(ts))
        assert isinstance(decoded, ci.TensorsRef)
        views = build_views(decoded, [storages[i] for i in range(len(storages))])
        for t, v in zip(ts, views, strict=True):
            assert_payload_equal(t, v)

    def test_slot_ref_round_trips(self) -> None:
        s = torch.empty(1 << 16, dtype=torch.uint8).untyped_storage()
        ref = ci.SlotRef(
            buffer=_share(s),
            buffer_id=0,
            dedicated=False,
            offset=4096,
            size=1000,
            event=bytes(64),
            event_id=3,
        )
        assert decode_ref(ci.encode(ref), _peer(), 1000) == ref

    def test_hello_round_trips_and_is_checked(self) -> None:
        info = ci.encode(ci.HelloInfo(pid=PID, device="GPU-A", release_event=bytes(64)))
        assert decode_hello(_peer(info=info)).device == "GPU-A"
        with pytest.raises(BackendError, match="pid"):
            decode_hello(_peer(pid=PID + 1, info=info))
        bad = ci.encode(ci.HelloInfo(pid=PID, device="GPU-A", release_event=b"x"))
        with pytest.raises(BackendError, match="event"):
            decode_hello(_peer(info=bad))
        with pytest.raises(BackendError, match="malformed"):
            decode_hello(_peer(info=b"\xc1"))

    @staticmethod
    def _tensors_ref(**share_changes: Any) -> tuple[ci.TensorsRef, int]:
        ts = [torch.arange(16, dtype=torch.int32)]
        ref, _ = _plan(ts)
        share = msgspec.structs.replace(ref.shares[0], **share_changes)
        return ci.TensorsRef(shares=[share], tensors=ref.tensors), packed_length(ts)

    @pytest.mark.parametrize(
        ("changes", "match"),
        [
            ({"counter": "/torch_1_2_3"}, "not the peer's process"),
            ({"counter": "/dev/shm/other"}, "not torch's"),
            ({"counter": ""}, "not torch's"),
            ({"counter_offset": 10000}, "slot"),
            ({"counter_offset": -1}, "slot"),
            ({"handle": bytes(2000)}, "memory handle"),
            ({"handle": b""}, "without a memory handle"),
            ({"event": b"short"}, "event"),
            ({"event": b"", "event_sync": True}, "event"),
            ({"nbytes": 8}, "reaches byte 64"),
            ({"nbytes": -1}, "out of range"),
            ({"device": ""}, "no GPU"),
        ],
    )
    def test_bad_shares_are_refused(self, changes: dict[str, Any], match: str) -> None:
        ref, nbytes = self._tensors_ref(**changes)
        with pytest.raises(BackendError, match=match):
            decode_ref(ci.encode(ref), _peer(), nbytes)

    @pytest.mark.parametrize(
        ("changes", "match"),
        [
            ({"share": 1}, "names share"),
            ({"dtype": "float128"}, "unknown dtype"),
            ({"stride": [1, 1]}, "shape/stride"),
            ({"offset": 1}, "reaches byte"),
            ({"shape": [17]}, "reaches byte"),
            ({"stride": [-1]}, "out of range"),
            ({"shape": [1 << 51]}, "out of range"),
        ],
    )
    def test_bad_tensors_are_refused(self, changes: dict[str, Any], match: str) -> None:
        ref, nbytes = self._tensors_ref()
        t = msgspec.structs.replace(ref.tensors[0], **changes)
        bad = ci.TensorsRef(shares=ref.shares, tensors=[t])
        with pytest.raises(BackendError, match=match):
            decode_ref(ci.encode(bad), _peer(), nbytes)

    def test_sizes_must_add_up(self) -> None:
        ref, nbytes = self._tensors_ref()
        with pytest.raises(BackendError, match="describes"):
            decode_ref(ci.encode(ref), _peer(), nbytes + 1)

    @pytest.mark.parametrize(
        ("changes", "nbytes", "match"),
        [
            ({"offset": 65000}, 1000, "outside"),
            ({"offset": -64}, 1000, "outside"),
            ({"size": 999}, 1000, "size 999"),
            ({"event": b""}, 1000, "event"),
            ({"buffer_id": 1 << 40}, 1000, "id out of range"),
        ],
    )
    def test_bad_slots_are_refused(self, changes: dict[str, Any], nbytes: int, match: str) -> None:
        s = torch.empty(1 << 16, dtype=torch.uint8).untyped_storage()
        ref = ci.SlotRef(
            buffer=_share(s),
            buffer_id=0,
            dedicated=False,
            offset=0,
            size=1000,
            event=bytes(64),
            event_id=0,
        )
        bad = msgspec.structs.replace(ref, **changes)
        with pytest.raises(BackendError, match=match):
            decode_ref(ci.encode(bad), _peer(), nbytes)

    @settings(max_examples=200, deadline=None)
    @given(st.binary(max_size=300))
    def test_garbage_is_only_ever_a_backend_error(self, data: bytes) -> None:
        with contextlib.suppress(BackendError):
            decode_ref(data, _peer(), 64)

    @settings(max_examples=200, deadline=None)
    @given(st.data())
    def test_mutated_references_are_only_ever_backend_errors(self, data: st.DataObject) -> None:
        ref, _ = _plan(_sample_tensors())
        raw = bytearray(ci.encode(ref))
        for _ in range(data.draw(st.integers(1, 4))):
            i = data.draw(st.integers(0, len(raw) - 1))
            raw[i] = data.draw(st.integers(0, 255))
        with contextlib.suppress(BackendError):
            decode_ref(bytes(raw), _peer(), packed_length(_sample_tensors()))


def test_a_failed_share_releases_those_already_made() -> None:
    ts = [torch.ones(4), torch.zeros(4), torch.ones(2)]
    released: list[int] = []
    made = iter(range(10))

    def share(s: torch.UntypedStorage) -> ci.Share:
        n = next(made)
        if n == 2:
            raise RuntimeError("Attempted to send CUDA tensor received from another process")
        return _share(s, n)

    with pytest.raises(RuntimeError):
        plan_shares(ts, share, lambda s: released.append(s.counter_offset))
    assert released == [0, 1]


# ----------------------------------------------------------------------- routing

CUDA_IPC = Candidate("cuda_ipc", CudaIpcBackend.capabilities, CudaIpcBackend.summary)
SHM = Candidate("shm", ShmBackend.capabilities, ShmBackend.summary)
LOCAL = Candidate("local", LocalBackend.capabilities, LocalBackend.summary)
CANDIDATES = (INLINE, LOCAL, SHM, CUDA_IPC)
GPU = frozenset({"cpu", "cuda"})


def _edge(
    locality: Locality = Locality.SAME_HOST,
    *,
    peer_access: bool = True,
    dst: frozenset[str] = GPU,
) -> Edge:
    return Edge("thinker", "talker", locality, GPU, dst, peer_access)


def _payload(
    devices: tuple[str, ...] = ("cuda",), kind: str = "payload", n: int = 1 << 20
) -> PayloadInfo:
    return PayloadInfo(kind, n, frozenset(devices), len(devices))  # type: ignore[arg-type]


class TestRouting:
    def test_gpu_stages_of_one_host_use_cuda_ipc(self) -> None:
        route = DefaultPolicy().select(_edge(), _payload(), CANDIDATES)
        assert route.backend == "cuda_ipc" and not route.fallback
        rejected = dict(route.rejected)
        assert rejected["shm"] == "would stage tensors through host memory"
        assert "same process" in rejected["local"]

    def test_small_cuda_stream_chunks_too(self) -> None:
        route = DefaultPolicy().select(_edge(), _payload(kind="stream_chunk", n=64), CANDIDATES)
        assert route.backend == "cuda_ipc"
        assert "cpu tensors only" in dict(route.rejected)["inline"]

    def test_without_peer_access_it_falls_back_to_shm_with_the_reason(self) -> None:
        route = DefaultPolicy().select(_edge(peer_access=False), _payload(), CANDIDATES)
        assert route.backend == "shm" and route.fallback
        assert "fallback" in route.reason
        assert "cannot access each other" in dict(route.rejected)["cuda_ipc"]

    def test_to_a_cpu_stage_it_falls_back(self) -> None:
        route = DefaultPolicy().select(_edge(dst=frozenset({"cpu"})), _payload(), CANDIDATES)
        assert route.backend == "shm" and route.fallback
        assert "not a GPU stage" in dict(route.rejected)["cuda_ipc"]

    def test_strict_mode_raises_listing_the_reasons(self) -> None:
        with pytest.raises(NoRouteError) as exc:
            StrictDefaultPolicy().select(_edge(peer_access=False), _payload(), CANDIDATES)
        rejected = dict(exc.value.rejected)
        assert "cannot access each other" in rejected["cuda_ipc"]
        assert rejected["shm"] == "would stage tensors through host memory"
        assert "cuda_ipc: the GPUs" in str(exc.value)

    @pytest.mark.parametrize("locality", [Locality.SAME_PROCESS, Locality.CROSS_HOST])
    def test_only_same_host(self, locality: Locality) -> None:
        remote = Candidate("remote", Capabilities(localities=frozenset(Locality), preference=60))
        route = DefaultPolicy().select(_edge(locality), _payload(), (*CANDIDATES, remote))
        assert route.backend == ("local" if locality is Locality.SAME_PROCESS else "remote")
        assert "reaches same host" in dict(route.rejected)["cuda_ipc"]

    @pytest.mark.parametrize("devices", [("cpu",), ("cpu", "cuda"), ()])
    def test_not_for_payloads_with_cpu_or_no_tensors(self, devices: tuple[str, ...]) -> None:
        route = DefaultPolicy().select(_edge(), _payload(devices), CANDIDATES)
        assert route.backend == "shm"
        assert "cuda_ipc" in dict(route.rejected)

    def test_a_configured_route_that_cannot_work_is_an_error(self) -> None:
        policy = StaticTablePolicy({"talker": "cuda_ipc"})
        with pytest.raises(NoRouteError, match="cannot access each other"):
            policy.select(_edge(peer_access=False), _payload(), CANDIDATES)

    def test_the_edge_knows_about_peer_access(self) -> None:
        from omniwire import hostinfo

        here = (DeviceInfo(kind="cpu"), DeviceInfo(kind="cuda", index=0, uuid="GPU-A"))
        there_same = (DeviceInfo(kind="cuda", index=0, uuid="GPU-A"),)
        there_other = (DeviceInfo(kind="cuda", index=0, uuid="GPU-B"),)
        assert hostinfo.gpu_peer_access(here, there_same)  # the same GPU
        assert not hostinfo.gpu_peer_access(here, there_other)  # not visible here
        assert not hostinfo.gpu_peer_access((DeviceInfo(kind="cpu"),), there_same)


# ----------------------------------------------------------------------- the backend, on a fake GPU


class FakeEvent:
    def __init__(self, handle: bytes) -> None:
        self.handle = handle
        self.recorded = 0
        self.done = True
        self.syncs = 0
        self.block = 0.0

    def record(self, stream: Any = None) -> None:
        self.recorded += 1

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.syncs += 1
        if self.block:
            time.sleep(self.block)
        self.done = True


class FakeGPU:
    """The backend's CUDA seam (:class:`CudaApi`), simulated with CPU storages inside
    this process: a share registers a storage under a handle; mapping the handle
    yields the same memory, as another process would see it. Counts, per share, how
    often torch's counter would be given back (by a mapped storage, or by a release).
    Passed to the backend as ``CudaIpcBackend(ctx, api=FakeGPU())``: no monkeypatching."""

    def __init__(self) -> None:
        self.storages: dict[bytes, torch.UntypedStorage] = {}
        self.made: list[ci.Share] = []
        self.given_back: collections.Counter[int] = collections.Counter()
        self.opened: collections.Counter[bytes] = collections.Counter()
        self.events: dict[bytes, FakeEvent] = {}
        self.unshareable: set[int] = set()
        self.fail_open: set[bytes] = set()
        self.tensor_gpu = 0
        self.alive = True
        self.peer_access_asked: list[tuple[int, int]] = []
        self.no_peer_access = False

    def availability(self) -> Availability:
        return Availability.ok()

    def init(self) -> None:
        pass

    def current_device(self) -> int:
        return 0

    def devices(self) -> tuple[DeviceInfo, ...]:
        return (
            DeviceInfo(kind="cpu"),
            DeviceInfo(kind="cuda", index=0, uuid="GPU-A"),
            DeviceInfo(kind="cuda", index=1, uuid="GPU-B"),
        )

    def process_alive(self, pid: int) -> bool:
        return self.alive

    def on_device(self, index: int) -> contextlib.AbstractContextManager[object]:
        return contextlib.nullcontext()

    def empty(self, nbytes: int, index: int) -> torch.Tensor:
        return torch.zeros(max(nbytes, 1), dtype=torch.uint8)

    def gpu_index(self, t: torch.Tensor) -> int | None:
        return self.tensor_gpu

    def sync_streams(self, indices: Any) -> None:
        pass

    def share(self, storage: torch.UntypedStorage, uuid_of: Any) -> ci.Share:
        if storage.data_ptr() in self.unshareable:
            raise RuntimeError("Attempted to send CUDA tensor received from another process")
        if storage.nbytes() == 0:
            return ci.Share(device=uuid_of(0), handle=b"", nbytes=0, offset=0)
        s = _share(storage, len(self.made), uuid_of(0))
        self.made.append(s)
        self.storages[s.handle] = storage
        return s

    def open_share(self, share: ci.Share, index: int) -> torch.UntypedStorage:
        if share.handle in self.fail_open:
            raise RuntimeError("cudaIpcOpenMemHandle failed: invalid argument")
        if not share.handle:
            return torch.UntypedStorage(0)
        self.opened[share.handle] += 1
        self.given_back[share.counter_offset] += 1  # by the mapped storage, when it dies
        return self.storages[share.handle]

    def release_share(self, share: ci.Share) -> None:
        self.given_back[share.counter_offset] += 1

    def new_event(self, index: int) -> tuple[FakeEvent, bytes]:
        handle = b"E" + len(self.events).to_bytes(8, "little") + bytes(55)
        self.events[handle] = FakeEvent(handle)
        return self.events[handle], handle

    def open_event(self, index: int, handle: bytes) -> FakeEvent:
        return self.events[handle]

    def record_after(self, event: Any, index: int, others: Any = ()) -> None:
        event.record()

    def local_events(self, devices: Any) -> list[FakeEvent]:
        return []

    def peer_access(self, a: int, b: int) -> bool:
        self.peer_access_asked.append((a, b))
        return not self.no_peer_access

    def mem_get_info(self, index: int) -> tuple[int, int]:
        return (0, 0)

    def ipc_collect(self) -> None:
        pass

    def balanced(self) -> bool:
        """Every share torch made was given back exactly once."""
        return all(self.given_back[s.counter_offset] == 1 for s in self.made)


def test_the_fake_implements_the_whole_seam() -> None:
    names = [n for n in dir(CudaApi) if not n.startswith("_")]
    assert names and all(callable(getattr(FakeGPU, n, None)) for n in names)
    assert all(callable(getattr(TorchCuda, n, None)) for n in names)


async def settle(*backends: CudaIpcBackend) -> None:
    """Wait until the backends' clean-up threads ran what was queued so far."""
    for b in backends:
        assert await anyio.to_thread.run_sync(b.wait_for_clean_ups, 5.0)


class Pair:
    """A sender and a receiver backend, connected as two processes of one host would be."""

    def __init__(
        self, fake: FakeGPU, recv_device: int = 0, zero_copy: bool = False, **opts: Any
    ) -> None:
        base = {"pool_size": 1 << 20, "min_block": 4096, **opts}
        self.a = CudaIpcBackend(BackendContext("a", 1, {**base, "device": 0}), api=fake)
        self.b = CudaIpcBackend(BackendContext("b", 2, {**base, "device": recv_device}), api=fake)
        self.zero_copy = zero_copy

    async def __aenter__(self) -> Pair:
        await self.a.start()
        await self.b.start()
        self.pa = PeerInfo("a", 1, PID, "h", "t", Locality.SAME_HOST, self.a.hello())
        self.pb = PeerInfo("b", 2, PID, "h", "t", Locality.SAME_HOST, self.b.hello())
        await self.a.connect(self.pb)
        await self.b.connect(self.pa)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.a.aclose()
        await self.b.aclose()

    async def announce(self, ts: list[torch.Tensor]) -> tuple[Any, bytes, packing.PackPlan]:
        """What the endpoint's announce does with a ByteBackend."""
        layout = packing.plan(ts)
        out: Export | None = await self.a.export_tensors(self.pb, ts, lent=False)
        if out is None:
            out = await self.a.export(self.pb, layout.nbytes, "cuda:0")
            assert out.buffer is not None
            packing.pack_into(out.buffer, ts, layout)
        if out.layout == "packed":
            await out.publish(0, layout.nbytes)
        return out, out.ref, layout

    async def take(
        self, info: bytes, layout: packing.PackPlan, per_tensor: bool
    ) -> list[torch.Tensor]:
        """What the endpoint's fetch does (copy mode unless zero_copy)."""
        n = layout.nbytes
        imp = await self.b.import_(self.pa, info, n)
        try:
            if per_tensor:
                await imp.fetch(0, n)
                got = list(imp.tensors or [])
                if not self.zero_copy:
                    got = [t.clone() for t in got]
            else:
                dest = None if self.zero_copy else torch.empty(n, dtype=torch.uint8)
                await imp.fetch(0, n, dest)
                source = dest if dest is not None else imp.buffer
                assert source is not None
                got = packing.unpack(source, layout.metas, copy=not self.zero_copy)
        finally:
            imp.close()
        return got

    async def round_trip(self, ts: list[torch.Tensor]) -> tuple[Any, list[torch.Tensor]]:
        out, info, layout = await self.announce(ts)
        got = await self.take(info, layout, out.layout == "per_tensor")
        out.release()  # the ACK
        return out, got


def _check_equal(expected: list[torch.Tensor], got: list[torch.Tensor]) -> None:
    assert len(expected) == len(got)
    for e, g in zip(expected, got, strict=True):
        assert_payload_equal(e, g)


class TestBackendOnAFakeGpu:
    @pytest.mark.asyncio
    async def test_same_gpu_maps_the_tensors_in_place(self) -> None:
        fake = FakeGPU()
        async with Pair(fake, recv_device=0, zero_copy=True) as p:
            ts = _sample_tensors()
            out, info, layout = await p.announce(ts)
            assert out.layout == "per_tensor" and out.nbytes == layout.nbytes
            got = await p.take(info, layout, per_tensor=True)
            _check_equal(ts, got)
            assert got[0].data_ptr() == ts[0].data_ptr()  # the same memory: no copy
            assert p.a.stats().exports == 1  # held until the ACK
            out.release()
            out.release()  # idempotent
            await settle(p.a, p.b)
            stats = p.a.stats()
            assert stats.idle and stats.detail["sent_in_place"] == 1
            assert stats.detail["pool_bytes_in_use"] == 0 and p.b.stats().idle
            assert len(fake.made) == 4  # five storages, one of them empty (no handle)
        assert fake.balanced()

    @pytest.mark.asyncio
    async def test_a_lazily_conjugated_or_negated_tensor_is_packed_not_shared(self) -> None:
        """Its storage holds other values than it reads as: shared in place, the
        receiver would rebuild those (the bit does not travel)."""
        fake = FakeGPU()
        async with Pair(fake, recv_device=0) as p:
            z = torch.complex(torch.arange(64.0), torch.ones(64))
            for ts in ([z.conj()], [torch._neg_view(torch.arange(64.0))], [z, z.conj()]):
                out, got = await p.round_trip(ts)
                assert out.layout == "packed"
                _check_equal([t.resolve_conj().resolve_neg() for t in ts], got)
            await settle(p.a, p.b)
        assert fake.balanced()

    @pytest.mark.asyncio
    async def test_another_gpu_goes_through_the_slot_pool(self) -> None:
        fake = FakeGPU()
        async with Pair(fake, recv_device=1) as p:
            for i in range(3):
                ts = [torch.randn(100, 3), torch.arange(i + 5)]
                out, info, layout = await p.announce(ts)
                assert out.layout == "packed"
                event = out.event
                before = (event.recorded, event.syncs)
                got = await p.take(info, layout, per_tensor=False)
                assert event.recorded == before[0] and event.syncs == before[1] + 1
                _check_equal(ts, got)
                out.release()
            d = p.a.stats().detail
            assert d["sent_pooled"] == 3 and d["sent_in_place"] == 0
            assert d["pool_bytes_in_use"] == 0 and p.a.stats().idle
            assert d["events"] == 1  # one interprocess event, reused
            assert p.b.stats().detail["mapped_buffers"] == 1
            # the pool is shared once for this receiver, and mapped once by it
            assert len(fake.made) == 1 and list(fake.opened.values()) == [1]
        await settle(p.a, p.b)
        assert fake.balanced()

    @pytest.mark.asyncio
    async def test_zero_copy_slots_wait_for_the_receivers_release(self) -> None:
        fake = FakeGPU()
        async with Pair(fake, recv_device=1, zero_copy=True, pool_size=64 << 10) as p:
            release = p.b._release_event
            assert isinstance(release, FakeEvent)
            ts = [torch.ones(32 << 10, dtype=torch.uint8)]  # half the pool
            out, info, layout = await p.announce(ts)
            got = await p.take(info, layout, per_tensor=False)
            assert got[0].data_ptr() == out.buffer.data_ptr()  # a view of the slot
            assert release.recorded == 1  # recorded when the views were released
            release.done = False  # ... but the GPU work on them is still running
            out.release()
            assert p.a.stats().detail["pool_deferred"] == 1
            out2, _, _ = await p.announce(ts)  # the other half: no waiting
            assert p.a.stats().detail["pool_deferred"] == 1
            assert out2.lease.offset != out.lease.offset
            # the pool is full: the sender waits (off the loop) for the release
            out3, _, _ = await p.announce(ts)
            assert release.syncs == 1
            assert out3.lease.offset == out.lease.offset and not out3.lease.dedicated
            out2.release()
            out3.release()
            assert p.a.stats().detail["pool_bytes_in_use"] == 0

    @pytest.mark.asyncio
    async def test_copy_mode_receivers_never_hold_slots(self) -> None:
        async with Pair(FakeGPU(), recv_device=1) as p:
            await p.round_trip([torch.ones(100)])
            assert isinstance(p.b._release_event, FakeEvent)
            assert p.b._release_event.recorded == 0
            assert p.a.stats().detail["pool_bytes_in_use"] == 0

    @pytest.mark.asyncio
    async def test_too_big_for_the_pool_gets_a_dedicated_buffer(self) -> None:
        fake = FakeGPU()
        async with Pair(fake, recv_device=1) as p:
            ts = [torch.randn(600_000)]  # 2.4 MB > the 1 MiB pool
            out, got = await p.round_trip(ts)
            _check_equal(ts, got)
            assert out.lease.buffer is None  # dropped on the ACK
            d = p.a.stats().detail
            assert d["sent_dedicated"] == 1 and d["pool_dedicated"] == 0
            assert p.b.stats().detail["mapped_buffers"] == 0  # mapped for that object only
            await settle(p.a, p.b)
        assert fake.balanced()

    @pytest.mark.asyncio
    async def test_a_timed_out_transfer_frees_its_slot_and_others_still_work(self) -> None:
        async with Pair(FakeGPU(), recv_device=1, timeout=0.2) as p:
            ts = [torch.arange(1000)]
            out, info, layout = await p.announce(ts)
            out.event.block = 1.0  # the sender's copy never "finishes" in time
            out.event.done = False
            with pytest.raises(BackendError, match=r"did not finish within 0\.2 s"):
                await p.take(info, layout, per_tensor=False)
            out.release()  # the NACK
            assert p.a.stats().detail["pool_bytes_in_use"] == 0
            assert p.b.stats().idle
            out.event.block = 0.0
            _, got = await p.round_trip(ts)
            _check_equal(ts, got)

    @pytest.mark.asyncio
    async def test_a_failed_mapping_gives_back_the_rest(self) -> None:
        fake = FakeGPU()
        async with Pair(fake, recv_device=0) as p:
            ts = [torch.ones(3), torch.zeros(5), torch.arange(7)]
            out, info, layout = await p.announce(ts)
            fake.fail_open.add(fake.made[1].handle)
            with pytest.raises(BackendError, match="cudaIpcOpenMemHandle"):
                await p.take(info, layout, per_tensor=True)
            out.release()
            await settle(p.a, p.b)
            assert [fake.given_back[s.counter_offset] for s in fake.made] == [1, 1, 1]
            assert p.b.stats().idle
            fake.fail_open.clear()
            _, got = await p.round_trip(ts)  # the backend still works
            _check_equal(ts, got)
            await settle(p.a, p.b)
        assert fake.balanced()

    @pytest.mark.asyncio
    async def test_refused_objects_give_back_torchs_counters(self) -> None:
        """A refused object is imported and closed unfetched (the backend is two-sided)."""
        assert CudaIpcBackend.capabilities.two_sided
        fake = FakeGPU()
        async with Pair(fake, recv_device=0) as p:
            ts = [torch.ones(3), torch.zeros(5)]
            out, info, layout = await p.announce(ts)
            (await p.b.import_(p.pa, info, layout.nbytes)).close()  # abort, full queue
            out.release()
            await settle(p.a, p.b)
            assert fake.balanced()
        fake = FakeGPU()
        async with Pair(fake, recv_device=1) as p:
            out, info, layout = await p.announce([torch.ones(3)])
            (await p.b.import_(p.pa, info, layout.nbytes)).close()
            out.release()
            await p.b.disconnect(p.pa)
            await settle(p.a, p.b)
        assert fake.balanced()

    @pytest.mark.asyncio
    async def test_a_storage_torch_cannot_share_goes_through_the_pool(self) -> None:
        fake = FakeGPU()
        async with Pair(fake, recv_device=0) as p:
            ts = [torch.ones(3), torch.arange(5)]
            fake.unshareable.add(ts[1].untyped_storage().data_ptr())
            out, got = await p.round_trip(ts)
            assert out.layout == "packed"
            _check_equal(ts, got)
            assert p.a.stats().detail["sent_pooled"] == 1
            await settle(p.a, p.b)
        assert fake.balanced()

    @pytest.mark.asyncio
    async def test_the_counters_of_a_dead_receiver_are_given_back(self) -> None:
        fake = FakeGPU()
        async with Pair(fake, recv_device=0) as p:
            out, _, _ = await p.announce([torch.ones(3)])
            out.release()  # the peer was lost before mapping it
            fake.alive = False
            await p.a.disconnect(p.pb)
            await settle(p.a)
            assert fake.balanced()
            with pytest.raises(BackendError, match="did not announce"):
                await p.a.export(p.pb, 10, "cuda:0")

    @pytest.mark.asyncio
    async def test_gpus_without_peer_access_are_refused_at_connect(self) -> None:
        fake = FakeGPU()
        fake.no_peer_access = True
        p = Pair(fake, recv_device=1)
        with pytest.raises(BackendError, match="cannot access each other"):
            await p.__aenter__()
        await p.__aexit__(None, None, None)
        async with Pair(fake, recv_device=0):  # one GPU: nothing to ask
            pass
        assert fake.peer_access_asked == [(0, 1)]

    @pytest.mark.asyncio
    async def test_refuses_foreign_and_unknown_things(self) -> None:
        async with Pair(FakeGPU(), recv_device=0) as p:
            ts = [torch.ones(3)]
            out, info, layout = await p.announce(ts)
            ref = decode_ref(info, p.pa, layout.nbytes)
            assert isinstance(ref, ci.TensorsRef)
            odd = ci.TensorsRef(
                shares=[msgspec.structs.replace(ref.shares[0], device="GPU-Z")],
                tensors=ref.tensors,
            )
            with pytest.raises(BackendError, match="not visible"):
                await p.b.import_(p.pa, ci.encode(odd), layout.nbytes)
            stranger = PeerInfo("c", 9, PID, "h", "t", Locality.SAME_HOST, b"")
            with pytest.raises(BackendError, match="did not announce"):
                await p.b.import_(stranger, info, layout.nbytes)
            far = PeerInfo("d", 3, PID, "h", "t", Locality.CROSS_HOST, p.a.hello())
            await p.b.connect(far)
            with pytest.raises(BackendError, match="this host only"):
                await p.b.import_(far, info, layout.nbytes)
            out.release()
            await p.a.aclose()
            with pytest.raises(BackendClosedError):
                await p.a.export(p.pb, 10, "cuda:0")
            with pytest.raises(BackendClosedError):
                await p.a.export_tensors(p.pb, ts, lent=True)


# ----------------------------------------------------------------------- scripts/gpu_check.sh


def test_gpu_check_script_is_valid_bash() -> None:
    subprocess.run(["bash", "-n", str(ROOT / "scripts" / "gpu_check.sh")], check=True)


def test_gpu_check_fails_clearly_without_a_gpu() -> None:
    if AVAILABILITY.available:
        pytest.skip("CUDA is available here: the script would run the whole check")
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMNIWIRE_PYTHON": sys.executable},
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "no CUDA device" in proc.stdout
    assert "Traceback" not in proc.stdout + proc.stderr


def _gpu_check_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    mod = sys.modules.get("gpu_check")
    if mod is None:
        mod = importlib.util.module_from_spec(spec)
        sys.modules["gpu_check"] = mod  # dataclasses look their module up there
        spec.loader.exec_module(mod)
    return mod


def test_gpu_check_pattern_is_device_independent() -> None:
    gc = _gpu_check_module()
    a = gc.pattern(100_000, 7, "cpu")
    assert a.dtype == torch.int32 and a.numel() == 100_000
    assert torch.equal(a, gc.pattern(100_000, 7, "cpu"))
    assert not torch.equal(a, gc.pattern(100_000, 8, "cpu"))
    x = torch.arange(100_000, dtype=torch.int64)
    assert torch.equal(a, ((x * 2654435761 + 7) & 0x7FFFFFFF).to(torch.int32))


@pytest.mark.parametrize("zero_copy", [False, True], ids=["copy", "zero-copy"])
def test_gpu_check_round_trip_logic_on_cpu(zero_copy: bool) -> None:
    """The script's two-process protocol (send, "got", bytes checked, "ok"), through shm."""
    gc = _gpu_check_module()
    results = anyio.run(gc.run_pair, 0, 0, zero_copy, (1 << 20,), True, "shm")
    assert len(results) == 1
    r = results[0]
    assert r.size == 1 << 20 and len(r.seconds) == 1 and r.seconds[0] > 0
    assert r.delivered_on == "cpu" and r.sent_via == "shm"


# =============================================================================== GPU


class TestCudaIpc(BackendConformance):
    """The conformance suite with every payload on the GPU (``device = "cuda"``)."""

    backend = "cuda_ipc"
    device = "cuda"
    backend_options = {"cuda_ipc": {"pool_size": 64 << 20}}  # noqa: RUF012

    @pytest.fixture(scope="class")
    @classmethod
    def backend_class(cls) -> type[Any]:
        need_gpus(1)
        return require_backend(cls.backend)


@pytest.mark.gpu
@pytest.mark.parametrize("zero_copy", [False, True], ids=["copy", "zero-copy"])
def test_same_gpu_two_process_round_trip(zero_copy: bool) -> None:
    need_gpus(1)
    gc = _gpu_check_module()
    results = anyio.run(gc.run_pair, 0, 0, zero_copy, (1 << 20, 16 << 20), True)
    assert [r.sent_via for r in results] == ["in place", "in place"]
    assert all(r.delivered_on.startswith("cuda") for r in results)


@pytest.mark.gpu
@pytest.mark.parametrize("zero_copy", [False, True], ids=["copy", "zero-copy"])
def test_cross_gpu_two_process_round_trip(zero_copy: bool) -> None:
    need_gpus(2)
    gc = _gpu_check_module()
    results = anyio.run(gc.run_pair, 0, 1, zero_copy, (1 << 20, 16 << 20), True)
    assert [r.sent_via for r in results] == ["slot pool", "slot pool"]


@pytest.mark.gpu
def test_a_pool_that_does_not_fit_fails_at_start() -> None:
    need_gpus(1)
    b = CudaIpcBackend(BackendContext("big", 1, {"pool_size": 1 << 50}))
    with pytest.raises(BackendError, match="pool_size"):
        anyio.run(b.start)
    anyio.run(b.aclose)
