"""The small promises of the public API: what a delivery and a receipt say, what
the codec refuses, ``omniwire --version``, and optional extras that cost nothing."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import tempfile

import anyio
import pytest
import torch

import omniwire
from omniwire import cli
from omniwire.delivery import SendReceipt
from omniwire.endpoint import Endpoint
from omniwire.errors import PeerLostError


def addr(name: str) -> str:
    return f"ipc://{tempfile.gettempdir()}/owt-{os.getuid()}/{name}-{secrets.token_hex(3)}"


@pytest.mark.asyncio
@pytest.mark.parametrize("backend", ["local", "shm"])
async def test_nbytes_and_requires_grad_per_backend(backend: str) -> None:
    """``nbytes`` is the tensor bytes whatever the backend; ``requires_grad`` survives
    only ``local``, which hands over the sender's tensor object (as documented)."""
    x = torch.ones(8, requires_grad=True)
    async with (
        Endpoint("b", address=addr("b")) as b,
        Endpoint("a", address=addr("a"), peers={"b": b.address}, routes={"b": backend}) as a,
    ):
        await a.wait_peer("b", 10)
        receipt = await a.send("b", {"x": x}, request_id="r")
        with anyio.fail_after(10):
            d = await b.receive()
            await receipt.wait()
        assert (d.backend, d.nbytes, receipt.nbytes) == (backend, 32, 32)
        assert d.payload["x"].requires_grad is (backend == "local")


@pytest.mark.asyncio
async def test_zero_copy_stays_true_after_release_and_released_says_so() -> None:
    async with (
        Endpoint("b", address=addr("b"), zero_copy=True) as b,
        Endpoint("a", address=addr("a"), peers={"b": b.address}, routes={"b": "shm"}) as a,
    ):
        await a.wait_peer("b", 10)
        await a.send("b", torch.ones(4), request_id="r")
        with anyio.fail_after(10):
            d = await b.receive()
        assert d.zero_copy and not d.released
        d.release()
        assert d.zero_copy and d.released
        await a.send("b", 1, request_id="inline-ish")  # copy mode value: nothing to release
        with anyio.fail_after(10):
            plain = await b.receive()
        assert not plain.released


@pytest.mark.asyncio
async def test_send_receipt_repr_tells_its_story() -> None:
    r = SendReceipt("far", "r1", 7, "shm", 4 << 20)
    assert repr(r) == "<SendReceipt to 'far' request='r1' object=7 via shm 4.0 MiB pending>"
    r.resolve()
    assert repr(r).startswith("<SendReceipt to 'far' request='r1' object=7 via shm 4.0 MiB ")
    assert "acknowledged in" in repr(r) and repr(r).endswith(" ms>")
    failed = SendReceipt("far", "r2", 8, "shm", 10)
    failed.resolve(PeerLostError("peer 'far' was lost: it died"))
    assert "10 B failed after" in repr(failed)
    assert "PeerLostError: peer 'far' was lost: it died>" in repr(failed)
    inline = SendReceipt.completed("far", "r3", "inline", 64)
    assert repr(inline).endswith("via inline 64 B handed off (no ACK needed)>")
    seen: list[SendReceipt] = []
    inline.add_done_callback(seen.append)  # done already: called at once
    assert seen == [inline]


@pytest.mark.asyncio
async def test_sets_are_refused_with_a_hint() -> None:
    async with (
        Endpoint("b", address=addr("b")) as b,
        Endpoint("a", address=addr("a"), peers={"b": b.address}) as a,
    ):
        await a.wait_peer("b", 10)
        with pytest.raises(TypeError, match=r"payload\['ids'\]: .*set.*send a list or a tuple"):
            await a.send("b", {"ids": {1, 2}}, request_id="r")


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.strip() == f"omniwire {omniwire.__version__} (wire 1.1)"


def test_optional_extras_are_not_imported_unless_used() -> None:
    code = (
        "import sys, omniwire.endpoint, omniwire.observe;"
        "print(sorted(m for m in ('prometheus_client', 'opentelemetry') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
