"""Every error names its reason; none is empty (issue 45: an error said
``peer 'r' was lost: `` and nothing more). Each test was seen failing first."""

from __future__ import annotations

import re

import anyio
import pytest
import torch

from omniwire.endpoint import Endpoint
from omniwire.errors import OmniwireError, PeerClosedError, PeerLostError, reason_text
from omniwire.testing import PeerProcess
from omniwire.testing.conformance import ipc_address

from lifecycle_support import counter, wait_until
from test_endpoint import pair

pytestmark = pytest.mark.asyncio

#: a reason that says nothing: an empty tail after a colon, or empty parentheses
_EMPTY = re.compile(r":\s*$|\(\s*\)|:\s*\)|:\s*;")


def _says_why(error: BaseException) -> bool:
    text = str(error)
    return bool(text.strip()) and not _EMPTY.search(text)


async def test_reason_text_is_never_empty() -> None:
    assert reason_text("", "no reason known") == "no reason known"
    assert reason_text(None, "no reason known") == "no reason known"
    assert reason_text(TimeoutError(), "x") == "TimeoutError"
    assert reason_text(OSError(5, ""), "x").strip()
    assert reason_text(ValueError("bad"), "x") == "bad"
    for cls in (PeerLostError, PeerClosedError):
        error = cls.of("r", "")
        assert _says_why(error), str(error)
        assert str(error).startswith("peer 'r' ")


async def test_the_error_of_a_send_whose_session_ended_names_a_reason() -> None:
    """Was: a send whose peer had come back as a new session (status READY or
    CONNECTING again, its reason cleared) failed with "peer 'b' was lost: "."""
    async with pair() as (a, _):
        peer = a._peers.get("b")
        assert peer is not None and peer.reason == ""
        error = a._peers.gone_error(peer)
        assert isinstance(error, PeerLostError)
        assert _says_why(error), str(error)


@pytest.mark.slow
@pytest.mark.timeout(90)
async def test_every_error_of_a_killed_peer_names_its_reason() -> None:
    """A receiver process that takes one delivery in 5 s is SIGKILLed while a stream
    and a sender of objects wait for its window: both fail with a PeerLostError
    that says why (this one held before the fix too: its reason is the dead
    process's; it guards the messages of a loss as a user meets them)."""
    peer = PeerProcess("victim", ipc_address("victim"), "--mode", "sink", "--delay", "5")
    errors: list[BaseException] = []
    try:
        async with Endpoint(
            "src",
            address=ipc_address("src"),
            peers={"victim": peer.address},
            peer_timeout=2,
            max_inflight=2,
        ) as ep:
            await ep.wait_peer("victim", 30)

            async def sender(kind: str) -> None:
                try:
                    for i in range(100_000):
                        if kind == "send":
                            payload = {"t": torch.ones(1 << 18)}  # 1 MiB: shm, a credit
                            receipt = await ep.send("victim", payload, request_id=f"r{i}")
                        else:
                            chunk = {"t": torch.ones(4096)}  # 16 KiB: inline, the window
                            receipt = await ep.stream("victim", chunk, request_id="s")
                        if receipt.error is not None:
                            errors.append(receipt.error)
                except OmniwireError as exc:
                    errors.append(exc)

            with anyio.fail_after(25):  # under ack_timeout (30 s): no deadline may end it
                async with anyio.create_task_group() as tg:
                    tg.start_soon(sender, "send")
                    tg.start_soon(sender, "stream")
                    await wait_until(lambda: counter(ep, "window_waits") >= 1, 20, "a wait")
                    await anyio.sleep(0.5)  # both wait now (the window is full)
                    peer.kill()
            assert counter(ep, "peers_lost") == 1
    finally:
        if peer.proc.poll() is None:
            peer.kill()
    assert len(errors) == 2, errors
    assert all(isinstance(e, PeerLostError) for e in errors), errors
    empty = [str(e) for e in errors if not _says_why(e)]
    assert not empty, empty
