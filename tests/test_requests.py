"""Request-scoped deliveries (``requests()``, ``deliveries(request_id=)``,
``receive(request_id=)``), the receive budget's unclaimed rule, and replies."""

from __future__ import annotations

import random
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from omniwire import Delivery
from omniwire.endpoint import DeliveryStream, Endpoint
from omniwire.errors import (
    EndpointClosedError,
    EndpointNotStartedError,
    OmniwireError,
    RequestAbortedError,
)

from test_endpoint import addr, pair

pytestmark = pytest.mark.asyncio


async def test_concurrent_requests_each_in_its_own_task_keep_order_and_lose_nothing() -> None:
    n_requests, n_chunks = 20, 6
    rng = random.Random(7)
    got: dict[str, list[tuple[str, int, Any]]] = {}
    routes = {"b:stream_chunk": "inline"}  # chunks inline, payloads as objects (local)
    async with pair(sender={"routes": routes}) as (a, b):

        async def serve(request: DeliveryStream) -> None:
            async with request:
                await anyio.sleep(rng.random() / 20)  # some tasks start late
                async for d in request:
                    got.setdefault(d.request_id, []).append((d.kind, d.chunk_id, d.metadata))
                    await anyio.sleep(rng.random() / 200)

        async def server() -> None:
            async with anyio.create_task_group() as tg:
                async for request in b.requests():
                    assert request.request_id is not None
                    tg.start_soon(serve, request)

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                tg.start_soon(server)
                # interleave every request's payload, chunks and end, round by round
                rids = [f"r{i}" for i in range(n_requests)]
                for rid in rids:
                    await a.send("b", {"x": torch.ones(2)}, request_id=rid, metadata=-1)
                for step in range(n_chunks):
                    rng.shuffle(rids)
                    for rid in rids:
                        await a.stream("b", torch.full((2,), step), request_id=rid, metadata=step)
                for rid in rids:
                    await a.end_stream("b", request_id=rid)
                while sum(len(v) for v in got.values()) < n_requests * (n_chunks + 2):
                    await anyio.sleep(0.01)
                tg.cancel_scope.cancel()
    assert sorted(got) == sorted(f"r{i}" for i in range(n_requests))
    for rid, items in got.items():
        kinds = [k for k, _, _ in items]
        assert kinds == ["payload"] + ["stream_chunk"] * n_chunks + ["stream_end"], rid
        assert [m for k, _, m in items if k == "stream_chunk"] == list(range(n_chunks)), rid
        assert [c for k, c, _ in items if k == "stream_chunk"] == list(range(n_chunks)), rid
    assert b.queued() == 0


async def test_a_held_request_is_not_taken_by_unscoped_consumers() -> None:
    async with pair() as (a, b):
        held = b.deliveries(request_id="mine")  # held from now, before anything arrives
        await a.send("b", 1, request_id="other-1")
        await a.send("b", 2, request_id="mine")
        await a.send("b", 3, request_id="other-2")
        await a.end_stream("b", request_id="mine")
        with anyio.fail_after(10):
            first = await b.receive()
            second = await b.receive()
            assert [first.request_id, second.request_id] == ["other-1", "other-2"]
            with pytest.raises(TimeoutError, match=r"no delivery within 0\.2 s"):
                await b.receive(timeout=0.2)  # only the held request is left
            mine = [d async for d in held]
        assert [(d.kind, d.payload) for d in mine] == [("payload", 2), ("stream_end", None)]
        assert held.ended
        # after its end the request is nobody's: a late delivery goes to anyone
        await a.send("b", 4, request_id="mine")
        with anyio.fail_after(10):
            assert (await b.receive()).payload == 4


async def test_receive_by_request_and_stage_waits_for_it_and_times_out_naming_it() -> None:
    async with Endpoint("c", address=addr("c")) as c, pair() as (a, b):
        c.add_peer("b", b.address)
        await c.wait_peer("b", 10)
        with pytest.raises(TimeoutError, match=r"no delivery of request 'r' from 'c' within"):
            await b.receive(timeout=0.2, request_id="r", from_stage="c")

        async def later() -> None:
            await anyio.sleep(0.1)
            await a.send("b", "from a", request_id="r")
            await c.send("b", "from c", request_id="r")

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(later)
                d = await b.receive(request_id="r", from_stage="c")
            assert (d.from_stage, d.payload) == ("c", "from c")
            d = await b.receive(request_id="r")
            assert (d.from_stage, d.payload) == ("a", "from a")


async def test_a_stream_of_one_stage_ends_on_its_end_and_on_an_abort_from_anywhere() -> None:
    async with Endpoint("c", address=addr("c")) as c, pair() as (a, b):
        c.add_peer("b", b.address)
        await c.wait_peer("b", 10)
        from_a = b.deliveries(request_id="r", from_stage="a")
        from_c = b.deliveries(request_id="r", from_stage="c")
        await a.stream("b", 1, request_id="r")
        await c.stream("b", 2, request_id="r")
        await c.end_stream("b", request_id="r")  # ends from_c only
        with anyio.fail_after(10):
            assert [d.kind async for d in from_c] == ["stream_chunk", "stream_end"]
            assert (await from_a.__anext__()).payload == 1
            await c.abort("r")  # b hears it from c; it ends a's stream too
            rest = [d async for d in from_a]
        assert [d.kind for d in rest] == ["aborted"]
        assert rest[0].from_stage == "c"


async def test_a_stream_closed_early_gives_the_rest_of_its_request_back() -> None:
    async with pair() as (a, b):
        for i in range(3):
            await a.stream("b", i, request_id="r")
        with anyio.fail_after(10):
            async with b.deliveries(request_id="r") as stream:
                assert (await stream.__anext__()).payload == 0
            assert stream.ended
            assert [(await b.receive()).payload for _ in range(2)] == [1, 2]


async def test_iterating_ends_when_the_endpoint_closes_and_refuses_before_start() -> None:
    ep = Endpoint("solo", address=addr("solo"))
    with pytest.raises(EndpointNotStartedError):
        ep.deliveries(request_id="r")
    with pytest.raises(EndpointNotStartedError):
        await ep.requests().__anext__()
    async with ep:
        stream = ep.deliveries(request_id="r")

        async def close_soon() -> None:
            await anyio.sleep(0.1)
            await ep.aclose()

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(close_soon)
                assert [d async for d in stream] == []
                assert [r async for r in ep.requests()] == []
    with pytest.raises(EndpointClosedError):
        await ep.receive(timeout=1)


async def test_an_unclaimed_delivery_does_not_block_the_others_forever() -> None:
    """The budget holds 2 objects; 2 of request 'gone' wait for a consumer that never
    comes; a consumer of 'new' waits. After unclaimed_timeout they are dropped, 'new'
    arrives, and 'gone' keeps one error delivery saying what happened."""
    async with pair(receive_buffer=2, unclaimed_timeout=0.3) as (a, b):
        for i in range(2):
            await a.send("b", {"t": torch.full((4,), i)}, request_id="gone")
        await a.send("b", {"t": torch.ones(4)}, request_id="new")
        with anyio.fail_after(20):
            d = await b.receive(request_id="new")
        assert torch.equal(d.payload["t"], torch.ones(4))
        assert b.counters["deliveries_unclaimed"] == 2
        with anyio.fail_after(10):
            late = await b.receive(request_id="gone")
        assert late.kind == "error"
        assert late.cause == "unclaimed"
        assert "waited" in (late.error or "") and "'gone'" in (late.error or "")
        assert b.queued() == 0
        await a.drain(10)  # the dropped ones were acknowledged: nothing stays reserved


async def test_a_slow_consumer_loses_nothing_to_the_unclaimed_rule() -> None:
    """Budget full, nobody waiting: nothing is dropped however long it takes."""
    async with pair(receive_buffer=2, unclaimed_timeout=0.2) as (a, b):
        for i in range(4):
            await a.send("b", i, request_id=f"r{i}")
        await anyio.sleep(1.0)  # several housekeeping ticks with the budget full
        with anyio.fail_after(10):
            got = [(await b.receive()).payload for _ in range(4)]
        assert got == [0, 1, 2, 3]
        assert b.counters["deliveries_unclaimed"] == 0


async def test_reply_reaches_the_sender_without_a_peers_entry() -> None:
    async with pair() as (a, b):
        reply_stream = a.deliveries(request_id="q", from_stage="b")
        await a.send("b", {"question": 6 * 7}, request_id="q")
        with anyio.fail_after(10):
            d = await b.receive()
            receipt = await d.reply({"answer": d.payload["question"]})
            for i in range(3):
                await d.stream_reply(torch.full((2,), i), metadata={"i": i})
            await d.end_reply()
            await receipt.wait(10)
            got = [x async for x in reply_stream]
        assert "a" not in b._core.config.peers  # b was never told a's address
        assert got[0].payload == {"answer": 42}
        assert [x.metadata["i"] for x in got if x.kind == "stream_chunk"] == [0, 1, 2]
        assert got[-1].kind == "stream_end"
        assert all(x.request_id == "q" for x in got)


async def test_reply_needs_a_delivery_that_came_from_an_endpoint() -> None:
    with pytest.raises(OmniwireError, match="nobody to reply through"):
        await Delivery("payload", "r", "x").reply(1)


@pytest.mark.asyncio
async def test_a_request_the_application_drops_unclosed_is_let_go() -> None:
    """Was: ``requests()`` kept the last stream it yielded referenced while it waited
    for the next request, so a stream the application dropped without closing it (a
    filter that skips it, a serve task that died first) held its request until some
    other request came: its delivery sat queued, out of every consumer's reach, and
    ``unclaimed_timeout`` never applies to a held request. Let go, it is dispatched
    again."""
    import gc

    async with pair() as (a, b):
        requests = b.requests().__aiter__()
        await (await a.send("b", {"i": 1}, request_id="r1")).wait(10)
        request = await requests.__anext__()
        assert request.request_id == "r1"
        del request  # dropped, not closed
        got: list[Any] = []

        async def next_request() -> None:
            got.append(await requests.__anext__())

        async with anyio.create_task_group() as tg:
            tg.start_soon(next_request)  # waits for the next request
            await anyio.sleep(0.1)
            gc.collect()  # r1 is nobody's now: the next request there is
            with anyio.fail_after(5):
                while not got:
                    await anyio.sleep(0.02)
        assert got[0].request_id == "r1"
        assert (await got[0].__anext__()).payload == {"i": 1}  # nothing of it lost


@pytest.mark.asyncio
async def test_a_stream_collected_unclosed_wakes_the_consumers_waiting() -> None:
    """Was: a ``DeliveryStream`` dropped without ``close()`` let its request go when
    the collector finalized it, but woke nobody: a ``receive()`` already waiting
    with no timeout slept on with the request's delivery queued (20 s and counting
    in a probe), until some other delivery arrived."""
    import gc

    async with pair() as (a, b):
        held = b.deliveries(request_id="r1")
        await (await a.send("b", {"i": 1}, request_id="r1")).wait(10)
        got: list[str] = []

        async def waiting() -> None:
            got.append((await b.receive()).request_id)

        async with anyio.create_task_group() as tg:
            tg.start_soon(waiting)
            await anyio.sleep(0.1)
            assert got == []  # r1 is held
            del held
            gc.collect()
            with anyio.fail_after(5):
                while not got:
                    await anyio.sleep(0.02)
        assert got == ["r1"]


async def test_an_abort_ends_the_aborting_sides_own_consumers_of_the_request() -> None:
    """Was: after ``a.abort(rid)``, ``a``'s own ``deliveries(request_id=rid)`` got no
    ``aborted`` delivery and no end: ``async for`` waited for ever (only the peers that
    heard the abort ended theirs). Now every consumer of the request ends — one reading
    when the abort is made, and one that comes after it — and no one else gets it."""
    async with pair() as (a, b):
        replies = a.deliveries(request_id="r", from_stage="b")
        await (await a.send("b", {"x": 1}, request_id="r")).wait(10)
        got: list[Delivery] = []
        with anyio.fail_after(10):
            d = await b.receive(request_id="r")
            await d.stream_reply(torch.ones(2))

            async def consume() -> None:
                async for x in replies:
                    got.append(x)

            async with anyio.create_task_group() as tg:
                tg.start_soon(consume)
                while not got:
                    await anyio.sleep(0.01)
                await a.abort("r", "its client went away")
        assert [x.kind for x in got] == ["stream_chunk", "aborted"]
        assert (got[-1].from_stage, got[-1].error) == ("a", "its client went away")
        assert replies.ended
        with anyio.fail_after(10):  # a consumer that comes after the abort ends as well
            assert [x.kind async for x in a.deliveries(request_id="r")] == ["aborted"]
            assert (await a.receive(request_id="r")).kind == "aborted"
        with pytest.raises(TimeoutError):  # and nothing of it reaches anyone else
            await a.receive(timeout=0.2)
    with pytest.raises(EndpointClosedError):  # closed: no delivery is made up any more
        await a.receive(timeout=1, request_id="r")


async def _no_new_request(ep: Endpoint, seconds: float) -> list[str]:
    """The requests ``ep.requests()`` yields within ``seconds`` (it should yield none)."""
    got: list[DeliveryStream] = []
    with anyio.move_on_after(seconds):
        async for request in ep.requests():
            got.append(request)  # held (not closed: it would come back at once)
    for request in got:
        request.close()
    return [str(request.request_id) for request in got]


async def test_a_request_served_and_done_is_not_yielded_again_by_a_later_abort() -> None:
    """Was: a request that brought only a payload, served by ``requests()`` and done
    (its serving task returned), came back from ``requests()`` as a *new* request
    whose only delivery was ``aborted`` when its sender aborted it later. A request
    is over for its consumer once its stream ended (or was closed): a later notice
    of it (an abort, a lost peer) is not queued; later data still is (test above)."""
    async with pair() as (a, b):
        await (await a.send("b", {"x": torch.ones(2)}, request_id="done")).wait(10)
        with anyio.fail_after(10):
            async for request in b.requests():
                async with request:  # served: its payload taken, answered, closed
                    d = await anext(request)
                    await (await d.reply({"ok": True})).wait(10)
                break
            assert (await a.receive(request_id="done")).payload == {"ok": True}
            await a.abort("done", "too late")
            while not b._core.aborts.is_aborted("done"):
                await anyio.sleep(0.01)
        assert await _no_new_request(b, 0.3) == []
        assert b.queued() == 0
        # while a request is being served, the abort reaches its own stream
        await (await a.send("b", {"x": torch.ones(2)}, request_id="live")).wait(10)
        with anyio.fail_after(10):
            request = await anext(b.requests())
            async with request:
                assert (await anext(request)).kind == "payload"
                await a.abort("live")
                assert [d.kind async for d in request] == ["aborted"]
        assert await _no_new_request(b, 0.3) == []
        # ... and stays its own when the serving task returns without reading it
        await (await a.send("b", {"x": torch.ones(2)}, request_id="busy")).wait(10)
        with anyio.fail_after(10):
            request = await anext(b.requests())
            async with request:
                assert (await anext(request)).kind == "payload"
                await a.abort("busy")
                while not b._core.aborts.is_aborted("busy"):
                    await anyio.sleep(0.01)
        assert await _no_new_request(b, 0.3) == []
        assert b.queued() == 0


def _readme_example(heading: str) -> str:
    """The first Python block under ``heading`` in the README, as it is written."""
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = text[text.index(f"\n{heading}\n") :]
    found = re.search(r"```python\n(.*?)```", section, re.S)
    assert found is not None, f"no Python block under {heading!r}"
    return found.group(1)


async def test_the_readmes_stream_back_while_watching_for_an_abort() -> None:
    """The README's pattern, run as written: an abort that comes while the engine is
    in the middle of a long step stops it at once; the requester's stream of the
    aborted request ends with ``aborted``, the other request's with ``stream_end``;
    neither request comes back to the server as a new one, even when aborted later."""
    namespace: dict[str, Any] = {"anyio": anyio, "RequestAbortedError": RequestAbortedError}
    steps: dict[str, int] = {}

    async def generate(payload: dict[str, Any]) -> AsyncIterator[torch.Tensor]:
        for i in range(payload["steps"]):
            await anyio.sleep(60 if i == 2 and payload["stall"] else 0.01)  # one engine step
            steps[payload["rid"]] = i + 1
            yield torch.full((2,), i)

    namespace["generate"] = generate
    exec(_readme_example("### Streaming back while watching for an abort"), namespace)
    served: list[str] = []
    returned: list[str] = []

    async with pair() as (a, b):

        async def run(request: DeliveryStream) -> None:
            await namespace["serve"](request)
            returned.append(str(request.request_id))

        async def server() -> None:
            async with anyio.create_task_group() as tg:
                async for request in b.requests():
                    served.append(str(request.request_id))
                    tg.start_soon(run, request)

        async with anyio.create_task_group() as tg:
            tg.start_soon(server)
            answers = {rid: a.deliveries(request_id=rid, from_stage="b") for rid in ("full", "cut")}
            for rid, stall in (("full", False), ("cut", True)):
                payload = {"rid": rid, "steps": 5, "stall": stall}
                await (await a.send("b", payload, request_id=rid)).wait(10)
            with anyio.fail_after(20):
                full = [d.kind async for d in answers["full"]]
                cut = [(await anext(answers["cut"])).kind for _ in range(2)]
                await a.abort("cut", "the client went away")  # the engine is mid-step
                cut += [d.kind async for d in answers["cut"]]
                while len(returned) < 2:
                    await anyio.sleep(0.01)
                await a.abort("full", "too late")  # over at b: no delivery there
                while not b._core.aborts.is_aborted("full"):
                    await anyio.sleep(0.01)
            await anyio.sleep(0.2)
            tg.cancel_scope.cancel()
    assert full == ["stream_chunk"] * 5 + ["stream_end"]
    assert cut == ["stream_chunk", "stream_chunk", "aborted"]
    assert steps == {"full": 5, "cut": 2}  # cut stopped in its third step
    assert sorted(served) == ["cut", "full"]  # each once
    assert sorted(returned) == ["cut", "full"]
