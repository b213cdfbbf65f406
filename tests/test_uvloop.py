"""omniwire under uvloop (what SGLang and vLLM run their processes on) and under trio
(refused at start(), naming trio). The README says both."""

from __future__ import annotations

import asyncio
import os
import secrets
import tempfile

import anyio
import pytest
import torch
import uvloop  # the test extra has it

from omniwire.endpoint import Endpoint
from omniwire.errors import ConfigurationError, RequestAbortedError


def _addr(name: str) -> str:
    return f"ipc://{tempfile.gettempdir()}/owt-{os.getuid()}/uv-{name}-{secrets.token_hex(3)}"


async def _pair_send_stream_abort() -> dict[str, object]:
    """A pair over shm (the same-host control ring too): a payload and its receipt, a
    3-chunk stream and its end, then an abort of a request mid-stream reaching the
    receiver and failing the sender's next chunk."""
    seen: dict[str, object] = {"loop": type(asyncio.get_running_loop()).__module__}
    with anyio.fail_after(30):
        async with (
            Endpoint("b", address=_addr("b")) as b,
            Endpoint("a", address=_addr("a"), peers={"b": b.address}, routes={"b": "shm"}) as a,
        ):
            await a.wait_peer("b", 10)
            hidden = torch.arange(1 << 18, dtype=torch.float32)
            await (await a.send("b", {"hidden": hidden}, request_id="r0")).wait(10)
            d = await b.receive(timeout=10)
            seen["payload"] = (d.kind, d.backend, bool(torch.equal(d.payload["hidden"], hidden)))

            for i in range(3):
                await a.stream("b", torch.full((1 << 14,), float(i)), request_id="s0")
            await a.end_stream("b", request_id="s0")
            chunks = []
            async with b.deliveries(request_id="s0") as stream:
                async for d in stream:
                    if d.kind != "stream_chunk":
                        break
                    chunks.append(float(d.payload[0]))
            seen["stream"] = (chunks, d.kind)

            await a.stream("b", torch.ones(4), request_id="x0")
            await a.abort("x0", "cancelled")
            while (d := await b.receive(timeout=10)).kind != "aborted":
                pass
            seen["abort"] = (d.request_id, d.from_stage, d.error)
            try:
                await a.stream("b", torch.ones(4), request_id="x0")
            except RequestAbortedError:
                seen["after_abort"] = "refused"
    return seen


def test_an_endpoint_pair_sends_streams_and_aborts_under_uvloop_run() -> None:
    seen = uvloop.run(_pair_send_stream_abort())
    assert seen["loop"].startswith("uvloop")  # type: ignore[attr-defined]
    assert seen["payload"] == ("payload", "shm", True)
    assert seen["stream"] == ([0.0, 1.0, 2.0], "stream_end")
    assert seen["abort"] == ("x0", "a", "cancelled")
    assert seen["after_abort"] == "refused"


def test_trio_is_refused_at_start_naming_trio_and_what_to_run_instead() -> None:
    address = _addr("t")

    async def main() -> None:
        with anyio.fail_after(10):
            async with Endpoint("t", address=address):
                pass

    with pytest.raises(ConfigurationError) as info:
        anyio.run(main, backend="trio")
    assert "not trio" in str(info.value)
    assert "uvloop.run" in str(info.value) and "backend='asyncio'" in str(info.value)
