"""What is forwarded by reference, exactly (README "Forwarding by reference"; spec
§9.2 "Forwarding"), pinned both ways: a payload whose tensors are one single tensor —
wherever it sits among dicts, lists, tuples and plain values, which travel in the
header — that is a non-empty, contiguous CPU tensor lying wholly inside a zero-copy
delivery not yet released, sent with ``lend=True``; anything else is packed once."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import pytest
import torch

from omniwire import Endpoint
from omniwire.testing.conformance import ipc_address

pytestmark = pytest.mark.asyncio

N = 4096  # float32 elements of the upstream tensor

Make = Callable[[torch.Tensor, torch.Tensor], Any]  # (x, y) of the delivery -> payload

#: (case, payload made of the delivery's tensors, lend, forwarded by reference?)
CASES: list[tuple[str, Make, bool, bool]] = [
    ("the tensor", lambda x, y: x, True, True),
    (
        "a dict of it and plain values",
        lambda x, y: {"features": x, "meta": {"step": 3}},
        True,
        True,
    ),
    ("in a list in a dict, beside a str", lambda x, y: {"f": [("x", x)], "n": "a"}, True, True),
    ("a contiguous slice of it", lambda x, y: {"part": x[1024:2048]}, True, True),
    ("a reshaped view of it", lambda x, y: x.view(64, 64), True, True),
    ("the same, without lend", lambda x, y: {"features": x, "meta": {"step": 3}}, False, False),
    ("two tensors of the delivery", lambda x, y: {"x": x, "y": y}, True, False),
    ("two slices of one tensor", lambda x, y: [x[:1024], x[1024:2048]], True, False),
    ("a strided view", lambda x, y: x[::2], True, False),
    ("a transposed view", lambda x, y: x.view(64, 64).t(), True, False),
    ("a tensor from elsewhere", lambda x, y: {"features": x.clone()}, True, False),
    ("an empty slice", lambda x, y: x[:0], True, False),
]


async def test_what_is_forwarded_by_reference_and_what_is_packed() -> None:
    async with (
        Endpoint("c", address=ipc_address("c"), zero_copy=True) as c,
        Endpoint(
            "b",
            address=ipc_address("b"),
            zero_copy=True,
            peers={"c": c.address},
            routes={"c": "shm"},
        ) as b,
        Endpoint("a", address=ipc_address("a"), peers={"b": b.address}, routes={"b": "shm"}) as a,
    ):
        await a.wait_peer("b", 10)
        await b.wait_peer("c", 10)
        x, y = torch.arange(N, dtype=torch.float32), torch.ones(8)
        upstream = await a.send("b", {"x": x, "y": y, "note": "hi"}, request_id="up")
        with anyio.fail_after(30):
            d = await b.receive()
            assert d.zero_copy
            got: dict[str, bool] = {}
            for case, make, lend, _ in CASES:
                payload = make(d.payload["x"], d.payload["y"])
                before = b.counters["objects_forwarded"]
                packed = b.counters["bytes_packed"]
                receipt = await b.send("c", payload, request_id=case, lend=lend)
                e = await c.receive(request_id=case)
                expected = make(x, torch.ones(8))
                if isinstance(expected, torch.Tensor):
                    assert torch.equal(e.payload, expected), case
                else:
                    assert repr(e.payload) == repr(expected), case
                got[case] = b.counters["objects_forwarded"] > before
                if got[case]:  # and no byte of it was packed
                    assert b.counters["bytes_packed"] == packed, case
                e.release()
                await receipt.wait(10)
            assert got == {case: forwarded for case, _, _, forwarded in CASES}
            d.release()
            await upstream.wait(10)
