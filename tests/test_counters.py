"""Endpoint counters: one registry of names and meanings (``COUNTERS``), every name
present from 0, an unknown name an error, no code using a name outside the
registry, the README's list equal to it (issue 47 item 14); and counters that
tell the truth (item 3): one abort counts once per endpoint, and a backend's
stats count the objects it carried, born in transport memory too."""

from __future__ import annotations

import ast
import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from omniwire import Endpoint
from omniwire.endpoint import COUNTERS
from omniwire.endpoint._stats import Counters, counters_list
from omniwire.errors import UnknownNameError
from omniwire.observe import Observer

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
#: Backends keep their own counters (``stats().detail``), not ``ep.counters``.
BACKENDS = ROOT / "src" / "omniwire" / "backends"
#: Test helpers whose second argument is a counter's name.
COUNTER_HELPERS = {"counter", "_Turns"}
#: In tests, these hold a backend instance (whose ``counters`` are its own).
BACKEND_HANDLES = {"mc", "backend", "nx", "nixl", "mooncake", "engine"}


def _uses(tree: ast.AST) -> Iterator[tuple[int, str, str]]:
    """(line, receiver, name) of each ``X.counters[...]`` / ``counters[...]`` /
    ``X.counters.get(...)`` whose name is a string literal (every literal of the key
    expression: ``counters["a" if x else "b"]`` uses both)."""
    for node in ast.walk(tree):
        target: ast.AST | None = None
        key: ast.AST | None = None
        if isinstance(node, ast.Subscript):
            target, key = node.value, node.slice
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in COUNTER_HELPERS
            and len(node.args) > 1
        ):  # a test helper that reads ep.counters[name]: counter(ep, "aborts")
            for name in _literals(node.args[1]):
                yield node.lineno, ast.unparse(node.args[0]), name
            continue
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("get", "update")
            and node.args
        ):
            target, key = node.func.value, node.args[0]
        if target is None or key is None:
            continue
        if isinstance(target, ast.Attribute) and target.attr == "counters":
            receiver = ast.unparse(target.value)
        elif isinstance(target, ast.Name) and target.id == "counters":
            receiver = ""
        else:
            continue
        for name in _literals(key):
            yield node.lineno, receiver, name


def _literals(node: ast.AST) -> list[str]:
    return [
        sub.value
        for sub in ast.walk(node)
        if isinstance(sub, ast.Constant) and isinstance(sub.value, str)
    ]


async def _until(check: Callable[[], bool], what: str, turns: int = 500) -> None:
    for _ in range(turns):  # bounded: 5 s
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"not seen within {turns} turns: {what}")


def test_no_code_uses_a_counter_name_outside_the_registry() -> None:
    files = [p for p in (ROOT / "src" / "omniwire").rglob("*.py") if BACKENDS not in p.parents]
    files += [p for p in sorted((ROOT / "tests").glob("*.py")) if p.name != Path(__file__).name]
    files += sorted((ROOT / "scripts").glob("*.py")) + sorted((ROOT / "examples").rglob("*.py"))
    seen: set[str] = set()
    unknown = []
    for path in files:
        for line, receiver, name in _uses(ast.parse(path.read_text(), str(path))):
            if receiver.split(".")[-1] in BACKEND_HANDLES:
                continue
            seen.add(name)
            if name not in COUNTERS:
                unknown.append(f"{path.relative_to(ROOT)}:{line}: {name!r}")
    assert not unknown, "counter names outside omniwire.endpoint.COUNTERS:\n" + "\n".join(unknown)
    assert "frames_received" in seen and "acks_sent" in seen  # (the scan finds them)


def test_the_scan_finds_names_in_every_form() -> None:
    code = (
        'a.counters["x"] += 1\ncounters["y" if f else "z"] += 1\nep.counters.get("w", 0)\n'
        'counter(ep, "v")\n'
    )
    assert sorted(n for _, _, n in _uses(ast.parse(code))) == ["v", "w", "x", "y", "z"]


def test_every_registered_name_is_there_from_zero_and_an_unknown_one_raises() -> None:
    ep = Endpoint("a")
    assert dict(ep.counters) == dict.fromkeys(COUNTERS, 0)
    with pytest.raises(UnknownNameError, match="abortz"):
        ep.counters["abortz"]
    with pytest.raises(KeyError, match="abortz"):
        ep.counters["abortz"] += 1
    with pytest.raises(KeyError, match="abortz"):
        ep.counters.get("abortz", 0)
    with pytest.raises(KeyError, match="abortz"):
        ep.counters.update({"abortz": 1})
    ep.counters["aborts"] += 2
    assert ep.counters.get("aborts", 0) == 2 and isinstance(ep.counters, Counters)


def test_every_name_has_a_meaning() -> None:
    for name, meaning in COUNTERS.items():
        assert name.isidentifier() and name.islower(), name
        assert meaning and "\n" not in meaning, name


def test_the_readme_counter_list_is_the_registry() -> None:
    text = README.read_text()
    start = text.index("<!-- counters:begin -->")
    end = text.index("<!-- counters:end -->")
    assert text[start:end].split("\n", 1)[1].strip() == counters_list().strip(), (
        "README's counter list differs from COUNTERS; paste the output of "
        "python -c 'from omniwire.endpoint._stats import counters_list; print(counters_list())'"
    )


@pytest.mark.asyncio
async def test_sends_of_buffers_born_in_shm_are_counted_in_the_backends_stats() -> None:
    """``ep.backend("shm").stats()`` after 50 sends of ``ep.empty`` buffers read
    exports=0, imports=0 (live handles, all gone) and nothing said what was carried."""
    n, shape = 50, (64, 1024)
    nbytes = 64 * 1024 * 4
    async with Endpoint("b") as b, Endpoint("a", peers={"b": b.address}, routes={"b": "shm"}) as a:
        await a.wait_peer("b")
        for i in range(n):
            buf = await a.empty("b", shape)
            buf.tensor.fill_(i)
            receipt = await a.send("b", buf.tensor, request_id=f"r{i}")
            d = await b.receive(timeout=10)
            assert torch.equal(d.payload, torch.full(shape, float(i)))
            await receipt.wait()
            buf.release()
        sent, got = a.backend("shm").stats(), b.backend("shm").stats()
        assert (sent.exports, got.imports) == (0, 0)  # nothing live any more
        assert (sent.objects_sent, sent.bytes_sent) == (n, n * nbytes)
        assert (got.objects_received, got.bytes_received) == (n, n * nbytes)
        assert (sent.objects_received, got.objects_sent) == (0, 0)


@pytest.mark.asyncio
async def test_one_abort_counts_once_at_each_endpoint_of_a_chain() -> None:
    """encoder → thinker → talker; the encoder aborts a request the three saw. Each
    hears of it up to three ways (broadcast, direct, forwarded); ``aborts`` counts the
    request once per endpoint, and an abort of it heard again later adds nothing."""
    async with (
        Endpoint("talker") as talker,
        Endpoint("thinker", peers={"talker": talker.address}) as thinker,
        Endpoint("encoder", peers={"thinker": thinker.address}) as encoder,
    ):
        await encoder.wait_peer("thinker")
        await thinker.wait_peer("talker")
        await talker.wait_peer("thinker")
        await thinker.wait_peer("encoder")
        await encoder.send("thinker", torch.ones(4), request_id="r")
        d = await thinker.receive(timeout=10)
        await thinker.send("talker", d.payload, request_id="r")
        await talker.receive(timeout=10)
        # talker → thinker → encoder also saw it: replies flow back up the chain
        await talker.stream("thinker", torch.ones(2), request_id="r")
        await thinker.receive(timeout=10)
        chain = (encoder, thinker, talker)
        await encoder.abort("r", "enough")
        await _until(lambda: all(ep.counters["aborts"] for ep in chain), "the abort everywhere")
        await thinker.abort("r")  # heard again, from the middle: the same request
        await talker.abort("r")
        # every copy of those aborts arrives well within this (one process, ipc)
        await asyncio.sleep(0.5)
        assert [ep.counters["aborts"] for ep in chain] == [1, 1, 1]
        await encoder.abort("other")  # a request nobody saw is still one abort here
        await _until(lambda: encoder.counters["aborts"] == 2, "the second abort")


class _Waits(Observer):
    def __init__(self) -> None:
        self.credit: list[str] = []
        self.window: list[str] = []

    def credit_waited(self, endpoint: str, peer: str, seconds: float) -> None:
        self.credit.append(peer)

    def window_waited(self, endpoint: str, peer: str, seconds: float) -> None:
        self.window.append(peer)


@pytest.mark.asyncio
async def test_credit_and_window_waits_are_told_and_counted_apart() -> None:
    """``credit_waited`` was called for window waits too, while its metric and the
    README say "credit"; now a window wait is ``window_waited`` / ``window_waits``."""
    waits = _Waits()
    async with (
        Endpoint("b", zero_copy=True, receive_window=4096) as b,
        Endpoint(
            "a",
            peers={"b": b.address},
            max_inflight=1,
            routes={"b": "shm", "b:stream_chunk": "inline"},
            observer=waits,
        ) as a,
    ):
        await a.wait_peer("b")
        # a credit wait: one object held unreleased, max_inflight=1
        await a.send("b", torch.ones(1024), request_id="c")
        held = await b.receive(timeout=10)
        second = asyncio.ensure_future(a.send("b", torch.ones(1024), request_id="c"))
        await _until(lambda: a.counters["credit_waits"] == 1, "the credit wait")
        held.release()
        await second
        (await b.receive(timeout=10)).release()
        assert (waits.credit, waits.window) == (["b"], [])
        assert a.counters["window_waits"] == 0
        # a window wait: inline chunks of 3,000 bytes against a 4,096-byte window
        await a.stream("b", torch.ones(750), request_id="w")
        third = asyncio.ensure_future(a.stream("b", torch.ones(750), request_id="w"))
        await _until(lambda: a.counters["window_waits"] == 1, "the window wait")
        await b.receive(timeout=10)  # taken: the window reopens
        await third
        await b.receive(timeout=10)
        assert (waits.credit, waits.window) == (["b"], ["b"])
        assert (a.counters["credit_waits"], a.counters["window_waits"]) == (1, 1)


def test_the_window_wait_has_its_own_metric() -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    from omniwire.observe import PrometheusObserver

    registry = prometheus_client.CollectorRegistry()
    metrics = PrometheusObserver(registry)
    metrics.window_waited("a", "b", 0.25)
    metrics.credit_waited("a", "b", 0.5)
    edge = {"endpoint": "a", "peer": "b"}
    assert registry.get_sample_value("omniwire_window_wait_seconds_sum", edge) == 0.25
    assert registry.get_sample_value("omniwire_credit_wait_seconds_sum", edge) == 0.5
