"""A traced stage for test_observe: ``python tests/trace_peer.py ADDRESS``.

Runs endpoint ``far`` with a TracingObserver on an in-memory exporter, prints
``READY <address>``, takes one request's deliveries up to its stream end, then
prints its finished spans as one JSON line and exits 0.
"""

from __future__ import annotations

import json
import sys

import anyio
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from omniwire.endpoint import Endpoint
from omniwire.observe import TracingObserver


async def main(address: str) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    async with Endpoint("far", address=address, observer=TracingObserver(provider)) as ep:
        print(f"READY {ep.address}", flush=True)
        with anyio.fail_after(30):
            async for request in ep.requests():
                async with request:
                    async for _ in request:
                        pass
                break
    spans = []
    for s in exporter.get_finished_spans():
        ctx = s.get_span_context()
        assert ctx is not None
        spans.append(
            {
                "name": s.name,
                "trace_id": ctx.trace_id,
                "span_id": ctx.span_id,
                "links": [[link.context.trace_id, link.context.span_id] for link in s.links],
                "attributes": dict(s.attributes or {}),
            }
        )
    print(json.dumps(spans), flush=True)


if __name__ == "__main__":
    anyio.run(main, sys.argv[1])
