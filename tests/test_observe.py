"""Metrics (Prometheus, scraped over HTTP) and tracing (OpenTelemetry, in-memory
exporter, linked across two processes); observers cost nothing when absent."""

from __future__ import annotations

import functools
import json
import os
import secrets
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import prometheus_client
import pytest
import torch
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from omniwire.endpoint import Endpoint
from omniwire.errors import HandshakeError, RequestAbortedError
from omniwire.observe import Observer, PrometheusObserver, TracingObserver, serve_metrics

pytestmark = pytest.mark.asyncio

HERE = Path(__file__).parent


def addr(name: str) -> str:
    return f"ipc://{tempfile.gettempdir()}/owt-{os.getuid()}/{name}-{secrets.token_hex(3)}"


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``{(sample name, sorted labels): value}`` from ``GET /metrics``."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture
def metrics() -> Iterator[tuple[PrometheusObserver, int]]:
    registry = prometheus_client.CollectorRegistry()
    observer = PrometheusObserver(registry)
    server, port = serve_metrics(registry, 0)
    try:
        yield observer, port
    finally:
        server.shutdown()
        server.server_close()


async def test_the_series_of_a_forgotten_peer_go_with_it(
    metrics: tuple[PrometheusObserver, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Was: every peer a stage ever talked to kept its label series for the life of
    the process: a server whose clients come and go under new names grew its metrics
    (and every scrape) without bound. When the peer table forgets a gone peer (it
    keeps the last 256), its series go too."""
    monkeypatch.setattr("omniwire.endpoint._peers._TOMBSTONES", 2)
    observer, port = metrics
    from lifecycle_support import clients_come_and_go

    async with Endpoint("srv", address=addr("srv"), observer=observer) as srv:
        await clients_come_and_go(srv, 6, remembered=2)
        samples = await anyio.to_thread.run_sync(scrape, port)
    peers = {dict(labels).get("peer") for (_name, labels) in samples} - {None}
    assert peers == {"c4", "c5"}  # the gone peers the table remembers


async def test_metrics_scraped_over_http_match_what_was_sent(
    metrics: tuple[PrometheusObserver, int],
) -> None:
    observer, port = metrics
    payload = {"h": torch.randn(1024)}  # 4 KiB of tensor data
    async with (
        Endpoint("b", address=addr("b"), zero_copy=True, observer=observer) as b,
        Endpoint(
            "a",
            address=addr("a"),
            peers={"b": b.address},
            routes={"b": "shm", "b:stream_chunk": "inline"},
            max_inflight=1,
            handshake_timeout=0.3,
            observer=observer,
        ) as a,
    ):
        await a.wait_peer("b", 10)
        with anyio.fail_after(20):
            for i in range(5):
                receipt = await a.send("b", payload, request_id=f"r{i}")
                (await b.receive()).release()
                await receipt.wait()
            for _ in range(3):
                await a.stream("b", torch.ones(16), request_id="s")
            await a.end_stream("b", request_id="s")
            for _ in range(4):
                await b.receive()  # 3 chunks and the end
            # a credit wait: one object unreleased, max_inflight=1
            first = await a.send("b", payload, request_id="w")
            held = await b.receive()

            async def release_soon() -> None:
                await anyio.sleep(0.2)
                held.release()

            async with anyio.create_task_group() as tg:
                tg.start_soon(release_soon)
                second = await a.send("b", payload, request_id="w")
            (await b.receive()).release()
            await first.wait()
            await second.wait()
        with pytest.raises(HandshakeError):
            await a.send("nobody", 1, request_id="x")
        samples = await anyio.to_thread.run_sync(scrape, port)

        edge = {"endpoint": "a", "peer": "b", "kind": "payload", "backend": "shm"}
        assert value(samples, "omniwire_sent_objects_total", **edge) == 7
        assert value(samples, "omniwire_sent_bytes_total", **edge) == 7 * 4096
        assert value(samples, "omniwire_send_latency_seconds_count", **edge) == 7
        assert value(samples, "omniwire_send_latency_seconds_sum", **edge) > 0
        chunks = {**edge, "kind": "stream_chunk", "backend": "inline"}
        assert value(samples, "omniwire_sent_objects_total", **chunks) == 3
        assert value(samples, "omniwire_sent_bytes_total", **chunks) == 3 * 64
        end = {**edge, "kind": "stream_end", "backend": "control"}
        assert value(samples, "omniwire_sent_objects_total", **end) == 1
        back = {"endpoint": "b", "peer": "a", "kind": "payload", "backend": "shm"}
        assert value(samples, "omniwire_received_objects_total", **back) == 7
        assert value(samples, "omniwire_received_bytes_total", **back) == 7 * 4096
        wait = {"endpoint": "b", "peer": "a", "kind": "payload"}
        assert value(samples, "omniwire_delivery_wait_seconds_count", **wait) == 7
        credit = {"endpoint": "a", "peer": "b"}
        assert value(samples, "omniwire_credit_wait_seconds_count", **credit) == 1
        assert value(samples, "omniwire_credit_wait_seconds_sum", **credit) > 0
        failed = {"endpoint": "a", "side": "send", "cause": "handshake"}
        assert value(samples, "omniwire_errors_total", **failed) == 1
        assert value(samples, "omniwire_peers", endpoint="a") == 1
        assert (
            value(samples, "omniwire_in_flight_objects", endpoint="a", peer="b", direction="out")
            == 0
        )
        assert value(samples, "omniwire_deliveries_queued", endpoint="b") == 0
        assert value(samples, "omniwire_events_total", endpoint="b", event="acks_sent") == 7
    # closed endpoints are no longer collected
    samples = await anyio.to_thread.run_sync(scrape, port)
    assert value(samples, "omniwire_peers", endpoint="a") == 0


def _spans(exporter: InMemorySpanExporter) -> list[dict[str, Any]]:
    return [_span_dict(s) for s in exporter.get_finished_spans()]


def _span_dict(s: ReadableSpan) -> dict[str, Any]:
    ctx = s.get_span_context()
    assert ctx is not None
    return {
        "name": s.name,
        "trace_id": ctx.trace_id,
        "span_id": ctx.span_id,
        "parent": s.parent.span_id if s.parent is not None else None,
        "links": [(link.context.trace_id, link.context.span_id) for link in s.links],
        "attributes": dict(s.attributes or {}),
        "status": s.status.status_code.name,
    }


async def test_spans_link_the_receiver_to_the_sender_across_two_processes() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    child = await anyio.to_thread.run_sync(
        functools.partial(
            subprocess.Popen,
            [sys.executable, str(HERE / "trace_peer.py"), addr("far")],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    )
    try:
        assert child.stdout is not None
        ready = await anyio.to_thread.run_sync(child.stdout.readline)
        assert ready.startswith("READY "), ready
        async with Endpoint(
            "near",
            address=addr("near"),
            peers={"far": ready.split()[1]},
            routes={"far:stream_chunk": "inline"},
            observer=TracingObserver(provider),
        ) as near:
            await near.wait_peer("far", 20)
            with anyio.fail_after(30), tracer.start_as_current_span("request"):
                receipt = await near.send(
                    "far", {"h": torch.ones(8192)}, request_id="r1"
                )  # over shm
                await near.stream("far", torch.ones(4), request_id="r1")
                await near.end_stream("far", request_id="r1")
                await receipt.wait()
        out, _ = await anyio.to_thread.run_sync(child.communicate, None, 30)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == 0, out
    theirs = json.loads(out.strip().splitlines()[-1])
    ours = _spans(exporter)
    by_name = {s["name"]: s for s in ours}
    request = by_name["request"]
    send = by_name["omniwire.send payload"]
    assert send["parent"] == request["span_id"] and send["trace_id"] == request["trace_id"]
    assert send["attributes"]["omniwire.request_id"] == "r1"
    assert list(send["attributes"]["omniwire.backends"]) == ["shm"]
    transfer = by_name["omniwire.transfer"]
    assert transfer["parent"] == send["span_id"] and transfer["status"] == "UNSET"
    chunk_send = by_name["omniwire.send stream_chunk"]
    end_send = by_name["omniwire.send stream_end"]
    delivered = {s["name"]: s for s in theirs}
    for kind, sent in (("payload", send), ("stream_chunk", chunk_send), ("stream_end", end_send)):
        span = delivered[f"omniwire.deliver {kind}"]
        assert span["links"] == [[sent["trace_id"], sent["span_id"]]], kind
        assert span["attributes"]["omniwire.request_id"] == "r1"
        assert span["attributes"]["omniwire.peer"] == "near"
        assert span["trace_id"] != sent["trace_id"] or span["span_id"] != sent["span_id"]


class _Counting(Observer):
    def __init__(self) -> None:
        self.calls: dict[str, int] = {}

    def __getattribute__(self, name: str) -> Any:
        attr = object.__getattribute__(self, name)
        if name in ("send_started", "delivered", "taken", "credit_waited"):
            calls = object.__getattribute__(self, "calls")
            calls[name] = calls.get(name, 0) + 1
        return attr


async def test_an_observer_sees_every_event_and_none_is_the_default() -> None:
    counting = _Counting()
    async with (
        Endpoint("b", address=addr("b"), observer=[counting]) as b,
        Endpoint("a", address=addr("a"), peers={"b": b.address}) as a,
    ):
        assert a.observer is None and b.observer is counting
        await a.wait_peer("b", 10)
        await a.send("b", 1, request_id="r")
        with anyio.fail_after(10):
            d = await b.receive()
            await d.reply(2)
            await a.receive()
        assert counting.calls == {"delivered": 1, "taken": 1, "send_started": 1}


async def test_abort_metrics_name_the_connection_and_one_vocabulary_of_causes(
    metrics: tuple[PrometheusObserver, int],
) -> None:
    """c aborts a request that came a → b → c: at a, the abort arrives from b (its
    origin, c, is two hops away). a's metrics name b; its refused send and b's
    aborted delivery count the same cause, "aborted"."""
    observer, port = metrics
    async with (
        Endpoint("c", address=addr("c")) as c,
        Endpoint("b", address=addr("b"), peers={"c": c.address}) as b,
        Endpoint("a", address=addr("a"), peers={"b": b.address}, observer=observer) as a,
    ):
        await a.wait_peer("b", 10)
        await b.wait_peer("c", 10)
        with anyio.fail_after(20):
            await a.send("b", 1, request_id="r")
            await b.send("c", (await b.receive()).payload, request_id="r")
            await c.receive()
            await c.abort("r", "c gave up")
            got = await a.receive()
        assert (got.kind, got.from_stage) == ("aborted", "c")
        with pytest.raises(RequestAbortedError):
            await a.send("b", 2, request_id="r")
        samples = await anyio.to_thread.run_sync(scrape, port)
    aborted = {"endpoint": "a", "kind": "aborted"}
    assert value(samples, "omniwire_delivery_wait_seconds_count", **aborted, peer="b") == 1
    assert value(samples, "omniwire_delivery_wait_seconds_count", **aborted, peer="c") == 0
    for side in ("send", "receive"):
        labels = {"endpoint": "a", "side": side, "cause": "aborted"}
        assert value(samples, "omniwire_errors_total", **labels) == 1, (side, samples)


_HOPS_SCRIPT = """
import sys, anyio, torch
from omniwire import Endpoint, hops
async def main():
    base = sys.argv[1]
    async with Endpoint("b", address=base + "-b", backends=["shm"]) as b:
        async with Endpoint("a", address=base + "-a", peers={"b": b.address},
                            backends=["shm"], routes={"b": "shm"}) as a:
            await a.wait_peer("b", 30)
            r = await a.send("b", {"x": torch.ones(1 << 18)}, request_id="q")
            (await b.receive(30)).release()
            await r.wait(30)
            assert hops.enabled()
anyio.run(main)
"""


async def test_hop_marks_are_written_at_exit_with_the_variable_and_cost_nothing_without(
    tmp_path: Path,
) -> None:
    """``OMNIWIRE_HOPS``: each hop of a backend object, in order, in one file per
    process; without it ``mark`` is the empty function and nothing is kept."""
    from omniwire import hops

    assert not hops.enabled() and hops.mark is hops._off
    hops.mark("anything")
    assert hops._marks == []
    out = tmp_path / "hops"
    env = {**os.environ, "OMNIWIRE_HOPS": str(out)}
    done = await anyio.to_thread.run_sync(
        functools.partial(
            subprocess.run,
            [sys.executable, "-c", _HOPS_SCRIPT, addr("hops")],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    )
    assert done.returncode == 0, done.stderr
    (path,) = out.glob("hops-*.json")
    names = [name for name, _ in json.loads(path.read_text())["marks"]]
    want = [
        "send: object path",
        "send: export ready (packed or registered)",
        "send: announced",
        "recv: take begins",
        "recv: imported, landing ready",
        "recv: read and unpacked",
        "recv: ACK posted",
        "send: ACK in",
    ]
    assert [n for n in names if n in want] == want  # each once, in the order of the hops
