"""omniwire.integrations.sglang_omni on the real sglang-omni 0.1.9.

sglang-omni is installed without its dependency tree (``pip install --no-deps
sglang-omni==0.1.9`` plus the light packages its comm/, relay/, pipeline/ and
scheduling/ modules import), into ``.venv/sglang-omni`` (``make setup`` does it). Its GPU engine ``sglang`` cannot
be installed on a CPU machine (CUDA builds of torch, flashinfer, sgl-kernel), and
sglang-omni's ``platforms`` module imports it at load to pick the device platform:
the ``sglang_cpu_fixture`` below puts ``tests/sglang_cpu_stub`` (a CPU-only
``sglang.srt.platforms`` and two helpers, nothing else) on the path, for this
process and the stage processes, only when the real ``sglang`` is not importable.
Without sglang-omni the module is skipped, or fails under OMNIWIRE_REQUIRE_ENGINES=1.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
STUB = ROOT / "tests" / "sglang_cpu_stub"
EXAMPLE = ROOT / "examples" / "sglang_omni" / "pipeline.py"

#: Where ``make setup`` installs sglang-omni 0.1.9 and its light imports: beside the
#: venv, not in it (its metadata names a GPU tree that ``pip check`` would report).
SITE = Path(os.environ.get("OMNIWIRE_SGLANG_OMNI_SITE", ROOT / ".venv" / "sglang-omni"))


@pytest.fixture(scope="module", autouse=True)
def sglang_cpu_fixture():  # type: ignore[no-untyped-def]
    """sglang-omni from SITE, and the CPU stand-in for ``sglang`` where the real one is
    missing (see the module doc), for this process and the stage processes."""
    saved_path, saved_env = list(sys.path), dict(os.environ)
    if SITE.is_dir():
        sys.path.append(str(SITE))  # after site-packages: the venv's own packages win
        os.environ["OMNIWIRE_SGLANG_OMNI_SITE"] = str(SITE)
    if importlib.util.find_spec("sglang_omni") is None:
        sys.path[:] = saved_path
        reason = "sglang-omni is not installed (make setup installs it in .venv/sglang-omni)"
        if os.environ.get("OMNIWIRE_REQUIRE_ENGINES") == "1":
            pytest.fail(reason + " (OMNIWIRE_REQUIRE_ENGINES=1: it must be)")
        pytest.skip(reason)
    spec = importlib.util.find_spec("sglang")
    if spec is None or str(spec.origin or "").startswith(str(STUB)):
        sys.path.insert(0, str(STUB))
        os.environ["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(STUB), os.environ.get("PYTHONPATH")])
        )
    yield
    sys.path[:] = saved_path
    os.environ.clear()
    os.environ.update(saved_env)


@pytest.fixture
def enabled():  # type: ignore[no-untyped-def]
    import omniwire.integrations.sglang_omni as sgo

    sgo.enable()
    yield sgo
    sgo.disable()


def cpu_router():  # type: ignore[no-untyped-def]
    from sglang_omni.comm.router import CommRouter

    return CommRouter(
        stage_name="src", gpu_id=None, same_process_targets=set(), gpu_stage_names=set()
    )


def test_cpu_stream_chunk_to_cpu_stage_routes_by_shm(enabled) -> None:  # type: ignore[no-untyped-def]
    from sglang_omni.comm.data_ref import TransportKind

    chunk = torch.zeros(65536, dtype=torch.uint8)
    assert cpu_router().outbound_stream("far", chunk) is TransportKind.SHM
    enabled.disable()
    with pytest.raises(ValueError, match="cannot be sent from 'src' to non-GPU target 'far'"):
        cpu_router().outbound_stream("far", chunk)


def test_registry_names_create_omniwire_relays(enabled) -> None:  # type: ignore[no-untyped-def]
    from sglang_omni.relay.base import create_relay

    from omniwire.integrations.sglang_omni._relay import OmniwireRelay

    for name in ("shm", "mooncake"):
        relay = create_relay(name, engine_id="x_relay", device="cpu", slot_size_mb=512, credits=2)
        assert isinstance(relay, OmniwireRelay)
        assert relay.kind == name
    enabled.disable()
    assert not isinstance(create_relay("shm", engine_id="x_relay", device="cpu"), OmniwireRelay)


def test_what_omniwire_does_not_carry_goes_to_the_relay_it_replaced() -> None:
    """cuda_ipc's paged-KV methods (register_kv_pool, put_kv_pages, ...) stay
    sglang-omni's own relay's; a name no relay has is still an AttributeError."""
    from omniwire.integrations.sglang_omni._relay import OmniwireRelay

    class Original:
        def __init__(self, engine_id: str, device: str, slot_size_mb: int) -> None:
            self.args = (engine_id, device, slot_size_mb)

        def register_kv_pool(self, pool: object) -> tuple[object, ...]:
            return (*self.args, pool)

    class Replacing(OmniwireRelay):
        kind = "cuda_ipc"
        fallback = Original

    relay = Replacing("g_relay", device="cuda:0", slot_size_mb=64)
    assert relay.register_kv_pool("pool") == ("g_relay", "cuda:0", 64, "pool")
    with pytest.raises(AttributeError):
        _ = OmniwireRelay("x_relay").register_kv_pool


def test_version_outside_the_series_is_refused(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from omniwire.integrations.sglang_omni import _compat

    monkeypatch.setattr(_compat, "installed_version", lambda: "0.2.0")
    with pytest.raises(_compat.SglangOmniCompatibilityError, match=r"sglang-omni 0\.2\.0.*0\.1\.x"):
        _compat.check()


def test_a_changed_internal_name_is_named(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from sglang_omni.comm.router import CommRouter

    import omniwire.integrations.sglang_omni as sgo

    monkeypatch.delattr(CommRouter, "outbound_stream")
    with pytest.raises(
        sgo.SglangOmniCompatibilityError, match=r"CommRouter\.outbound_stream is gone"
    ):
        sgo.enable()
    assert not sgo.enabled()

    monkeypatch.undo()

    async def changed(self, target):  # type: ignore[no-untyped-def]
        return None

    monkeypatch.setattr(CommRouter, "outbound_stream", changed)
    with pytest.raises(sgo.SglangOmniCompatibilityError, match="changed its parameters"):
        sgo.enable()


@pytest.mark.asyncio
async def test_small_tensor_travels_in_the_relay_metadata() -> None:
    """No endpoint is needed at all: the bytes are in the metadata sglang-omni sends."""
    from omniwire.integrations.sglang_omni._relay import OmniwireRelay

    relay = OmniwireRelay(engine_id="nobody_relay")
    src = torch.arange(1024, dtype=torch.uint8)
    op = await relay.put_async(src, request_id="r1", receiver_id="far")
    assert op.metadata["transfer_info"]["inline"] == src.numpy().tobytes()
    dest = torch.zeros(1024, dtype=torch.uint8)
    got = await relay.get_async(op.metadata, dest, request_id="r1")
    await got.wait_for_completion()
    assert torch.equal(dest, src)


async def _two_wires(tmp_path: Path):  # type: ignore[no-untyped-def]
    from omniwire import Endpoint
    from omniwire.integrations.sglang_omni._wire import StageWire, endpoint_options

    addrs = {s: f"ipc://{tmp_path}/{s}.ow" for s in ("src", "far")}
    wires = []
    for s in ("src", "far"):
        ep = Endpoint(
            s,
            address=addrs[s],
            peers={o: a for o, a in addrs.items() if o != s},
            **endpoint_options(gpu=False, remote=False),
        )
        w = StageWire(ep, f"{s}_relay")
        await w.start()
        wires.append(w)
    await wires[0].ep.wait_peer("far", timeout=10)
    return wires


@pytest.mark.asyncio
async def test_large_tensor_through_omniwire_and_abort(tmp_path: Path) -> None:
    from omniwire.errors import RequestAbortedError
    from omniwire.integrations.sglang_omni._relay import OmniwireRelay

    src_wire, far_wire = await _two_wires(tmp_path)
    try:
        sender, receiver = OmniwireRelay("src_relay"), OmniwireRelay("far_relay")
        data = torch.randint(0, 255, (1 << 20,), dtype=torch.uint8)
        op = await sender.put_async(data, request_id="r1", receiver_id="far")
        info = op.metadata["transfer_info"]
        assert "inline" not in info and info["from"] == "src" and info["address"]
        dest = torch.zeros(1 << 20, dtype=torch.uint8)
        got = await receiver.get_async(op.metadata, dest, request_id="r1")
        await got.wait_for_completion(timeout=10)
        assert torch.equal(dest, data)
        op.mark_receiver_done()
        await op.wait_for_completion(timeout=10)  # the omniwire ACK came

        # A stream chunk's object id maps to its request; an abort releases it on
        # both sides and fails the receiver's read instead of letting it wait.
        op2 = await sender.put_async(data, request_id="r2:stream:src:far:0:0", receiver_id="far")
        sender.abort("r2")
        await op2.wait_for_completion(timeout=10)  # aborted: released, not an error
        for _ in range(200):  # the abort travels to far (bounded: 10 s)
            if "r2" in far_wire.failed:
                break
            await asyncio.sleep(0.05)
        assert not far_wire.arrived  # what had arrived of r2 was released
        got2 = await receiver.get_async(op2.metadata, dest, request_id="r2:stream:src:far:0:0")
        with pytest.raises(RequestAbortedError):
            await got2.wait_for_completion(timeout=10)
    finally:
        await src_wire.aclose()
        await far_wire.aclose()


@pytest.mark.asyncio
async def test_an_object_sent_survives_its_sender_closing(tmp_path: Path) -> None:
    """The object reached far's endpoint, then the sending stage stopped before
    sglang-omni's get_async asked for it: far still reads the right bytes (a zero-copy
    delivery keeps its memory until released)."""
    from omniwire.integrations.sglang_omni._relay import OmniwireRelay

    src_wire, far_wire = await _two_wires(tmp_path)
    try:
        sender, receiver = OmniwireRelay("src_relay"), OmniwireRelay("far_relay")
        data = torch.randint(0, 255, (1 << 20,), dtype=torch.uint8)
        op = await sender.put_async(data, request_id="r3", receiver_id="far")
        for _ in range(200):  # far's endpoint took it (bounded: 10 s)
            if far_wire.arrived:
                break
            await asyncio.sleep(0.05)
        await src_wire.aclose()
        dest = torch.zeros(1 << 20, dtype=torch.uint8)
        got = await receiver.get_async(op.metadata, dest, request_id="r3")
        await got.wait_for_completion(timeout=20)
        assert torch.equal(dest, data)
    finally:
        await src_wire.aclose()
        await far_wire.aclose()


@pytest.mark.asyncio
async def test_an_object_nobody_reads_gives_its_credit_back(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A delivery whose DataReady sglang-omni never reads is released after
    UNCLAIMED_S (0 here), so the sender's credit and slot come back."""
    from omniwire.integrations.sglang_omni import _wire
    from omniwire.integrations.sglang_omni._relay import OmniwireRelay

    monkeypatch.setattr(_wire, "UNCLAIMED_S", 0.0)
    src_wire, far_wire = await _two_wires(tmp_path)
    try:
        op = await OmniwireRelay("src_relay").put_async(
            torch.ones(1 << 20, dtype=torch.uint8), request_id="r4", receiver_id="far"
        )
        await op.wait_for_completion(timeout=20)  # the ACK came with no get_async
        assert not far_wire.arrived
    finally:
        await src_wire.aclose()
        await far_wire.aclose()


@pytest.mark.asyncio
async def test_sglang_omni_cleanup_aborts_the_request_in_omniwire(enabled, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """CommEngine.cleanup (sglang-omni's abort path: Stage.on_abort) aborts in omniwire:
    the sender's pending object is released, the receiver's read fails at once."""
    from sglang_omni.comm.data_ref import TransportKind
    from sglang_omni.comm.engine import CommEngine
    from sglang_omni.comm.router import CommRouter

    from omniwire.errors import RequestAbortedError
    from omniwire.integrations.sglang_omni._relay import OmniwireRelay

    src_wire, far_wire = await _two_wires(tmp_path)
    try:
        engine = CommEngine(
            CommRouter(
                stage_name="src", gpu_id=None, same_process_targets=set(), gpu_stage_names=set()
            )
        )
        relay = engine.router.relay(TransportKind.SHM)  # built through the registry
        assert isinstance(relay, OmniwireRelay)
        op = await relay.put_async(
            torch.ones(1 << 20, dtype=torch.uint8), request_id="r5", receiver_id="far"
        )
        engine.cleanup("r5")
        assert "r5" in src_wire.failed
        await op.wait_for_completion(timeout=10)  # released by the abort
        for _ in range(200):  # the abort reaches far (bounded: 10 s)
            if "r5" in far_wire.failed:
                break
            await asyncio.sleep(0.05)
        got = await OmniwireRelay("far_relay").get_async(
            op.metadata, torch.zeros(1 << 20, dtype=torch.uint8)
        )
        with pytest.raises(RequestAbortedError):
            await got.wait_for_completion(timeout=10)
    finally:
        await src_wire.aclose()
        await far_wire.aclose()


def test_pth_hook_enables_on_import_of_the_stage_runtime(tmp_path: Path) -> None:
    from omniwire.integrations.sglang_omni.__main__ import main

    assert main(["install-pth", "--site", str(tmp_path)]) == 0
    code = (
        f"import site; site.addsitedir({str(SITE)!r}); site.addsitedir({str(tmp_path)!r}); "
        "import sglang_omni.pipeline.stage.runtime; "
        "from sglang_omni.relay.base import RELAY_REGISTRY; "
        "import omniwire.integrations.sglang_omni as s; "
        "print(getattr(RELAY_REGISTRY.get('shm'), '__name__', None), s.enabled())"
    )
    for flag, expected in (("1", "OmniwireShmRelay True"), ("0", "None False")):
        env = {**os.environ, "OMNIWIRE_SGLANG_OMNI": flag, "OMP_NUM_THREADS": "1"}
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.strip().endswith(expected), out.stdout


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def run_example(*args: str) -> dict[str, object]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SGLANG_OMNI_STARTUP_TIMEOUT": "120"}
    out = subprocess.run(
        [sys.executable, str(EXAMPLE), "--requests", "2", "--timeout", "120", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    print(out.stdout)
    # `make test` prints build/evidence/ after the suite: CI's log shows both runs
    evidence = Path(__file__).resolve().parents[1] / "build" / "evidence"
    evidence.mkdir(parents=True, exist_ok=True)
    with (evidence / "sglang-omni-toy-pipeline.txt").open("a") as f:
        f.write(f"$ {EXAMPLE.name} {' '.join(args)}\n{out.stdout.strip()}\n")
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_toy_pipeline_same_results_with_omniwire() -> None:
    """src → near (same process) and → far (another process), and a stream to far.

    sglang-omni alone succeeds with the 64-byte chunk (it travels inline in its own
    message) and kills the source stage with the 64 KiB one (``outbound_stream``'s
    ValueError); with omniwire both succeed and agree with sglang-omni alone.
    """
    alone = run_example("--chunk", "64")
    wired = run_example("--omniwire", "--chunk", "64", "--chunk", "65536")
    assert wired["omniwire"] is True
    for rid, res in alone["results"].items():
        assert "error" not in res, res
        got = wired["results"][rid]
        assert "error" not in got, got
        assert got["near"] == res["near"]
        assert got["far"]["enc"] == res["far"]["enc"] == res["near"]["enc"]
        assert got["far"]["chunks"][0] == res["far"]["chunks"][0]
        seed = int(rid.split("-")[1])
        big = torch.full((65536,), (seed + 1) % 251, dtype=torch.uint8)
        assert got["far"]["chunks"][1] == [65536, digest(big)]
