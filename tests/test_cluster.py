"""Many hosts on one machine: network namespaces as hosts (``omniwire.testing.cluster``).

Every endpoint runs in a namespace host with its own network stack, address and
/dev/shm; host identity comes from detection alone (no ``OMNIWIRE_HOST_ID``).
The pipeline example runs across hosts over each cross-host engine, and with one
stage pair sharing a host. Needs root: fails rather than skips under
``OMNIWIRE_REQUIRE_ENGINES=1``.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from omniwire.testing import require_backend
from omniwire.testing.cluster import Cluster, Host, cluster_or_skip

RUN = Path(__file__).resolve().parents[1] / "examples" / "pipeline" / "run.py"
pytestmark = [pytest.mark.slow]


def host_env(host: Host) -> list[str]:
    """The per-host engine settings: UCX and gloo bind to the host's veth, and UCX
    moves bytes over TCP (its shared-memory transports would reach across the
    namespaces of one kernel, as no two real hosts can)."""
    ucx = [f"UCX_NET_DEVICES={host.ifname}", "UCX_TLS=tcp"]
    return ["env", *ucx, f"GLOO_SOCKET_IFNAME={host.ifname}"]


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMNIWIRE_HOST_ID", "UCX_NET_DEVICES")}
    return {**env, "OMP_NUM_THREADS": "1", "MC_LOG_LEVEL": "ERROR"}


def _namespaces() -> set[str]:
    return set(
        subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    )


def _maker_alive(netns: str) -> bool:
    """Whether the process that made a namespace host (``owc-<pid>-...``) still runs."""
    from omniwire.hostinfo import pid_alive

    pid = netns.split("-")[1] if netns.startswith("owc-") else ""
    return not pid.isdigit() or pid_alive(int(pid))


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with cluster_or_skip(("a", "b", "c"), rate={"a": "10gbit", "b": "10gbit", "c": "1gbit"}) as c:
        yield c
        left = {h.name: h.shm() for h in c.hosts.values() if h.shm()}
        assert not left, f"left in /dev/shm: {left}"


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    ("engine", "placement"),
    [
        ("mooncake", "abc"),
        ("nixl", "abc"),
        ("nccl", "abc"),
        ("mooncake", "aab"),  # encoder and thinker share host a: shm between them
    ],
)
def test_pipeline_across_namespace_hosts(cluster: Cluster, engine: str, placement: str) -> None:
    require_backend(engine)
    encoder, thinker, talker = (cluster[h] for h in placement)
    args = []
    for stage, host in (("encoder", encoder), ("thinker", thinker), ("talker", talker)):
        # the talker's port fixed (nothing else listens in a namespace host): it and
        # the thinker start at once
        port = 47101 if stage == "talker" else 0
        args += ["--bind", f"{stage}=tcp://{host.ip}:{port}"]
        if stage != "encoder":
            args += ["--launch", f"{stage}={shlex.join(host.command(host_env(host)))}"]
    if engine != "mooncake":  # the default policy's choice for another host
        args += ["--prefer", engine]
    # the thinker's hidden-state fan-out: shm to a stage on its host, the engine elsewhere
    for peer, host in (("talker", talker), ("encoder", encoder)):
        args += ["--expect", f"{peer}={'shm' if host is thinker else engine}"]
    done = encoder.run(
        [*host_env(encoder), sys.executable, str(RUN), "--requests", "3", "--json", *args],
        timeout=180,
        capture_output=True,
        text=True,
        env=clean_env(),
    )
    assert done.stdout.strip(), done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["problems"] == [], out["problems"]
    assert done.returncode == 0, done.stderr
    status = {r["request"]: r["status"] for r in out["results"]}
    assert status == {"req-0": "done", "req-1": "aborted", "req-2": "done"}
    for host in cluster.hosts.values():
        assert host.pids() == [], f"processes left on {host}"
        assert host.shm() == [], f"left in /dev/shm of {host}"


# -- partitions, heals and host death --------------------------------------------------

PEER = Path(__file__).resolve().parent / "cluster_peer.py"
PEER_TIMEOUT = 2.0
RESUME_WINDOW = 1.0


class Side:
    """A ``cluster_peer.py`` process in a host; its JSON lines read by a thread."""

    def __init__(self, host: Host, *args: str) -> None:
        self.host = host
        self.stderr = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed by finish/kill; a pipe could fill and stall it)
        self.proc = host.popen(
            [*host_env(host), sys.executable, str(PEER), *args],
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
            env=clean_env(),
        )
        self.lines: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.seen: list[dict[str, Any]] = []
        self.address = ""
        threading.Thread(target=self._read, daemon=True).start()
        if args[0] == "recv":
            self.address = self.expect(lambda m: "ready" in m, 30)["ready"]

    def _read(self) -> None:
        assert self.proc.stdout is not None
        with self.proc.stdout:
            for line in self.proc.stdout:
                if line.startswith("{"):
                    self.lines.put(json.loads(line))
        self.lines.put(None)

    def expect(self, pred: Callable[[dict[str, Any]], bool], timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                m = self.lines.get(timeout=left)
            except queue.Empty:
                break
            if m is None:
                break
            self.seen.append(m)
            if pred(m):
                return m
        raise AssertionError(f"no such line within {timeout} s; seen {self.seen[-6:]}")

    def finish(self, timeout: float = 30) -> list[dict[str, Any]]:
        """Wait for the exit (a receiver is sent SIGTERM first); every line it printed.
        Asserts the exit code is 0."""
        if self.address and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(
                f"{self.host.name}: no exit within {timeout} s; seen {self.seen[-8:]}"
            ) from None
        with contextlib.suppress(AssertionError):
            self.expect(lambda m: False, 5)  # the rest of its lines
        self.stderr.seek(0)
        err = self.stderr.read()
        self.stderr.close()
        assert code == 0, f"{self.host.name}: exit {code}: {err[-3000:]}"
        return self.seen

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        if not self.stderr.closed:
            self.stderr.close()


def start_pair(
    cluster: Cluster,
    engine: str,
    *extra: str,
    landing: bool = True,
    resume_window: float = RESUME_WINDOW,
) -> tuple[Side, Side, Host, Host]:
    """The receiver first, then the sender with the address it bound. (Started both at
    once, on a fixed port, the first mooncake transfer after a heal stalled until
    the ACK timeout in 4 of 26 runs of the partition case, and in none of 10 this
    way: not understood yet, see the closing note of the namespace-hosts issue.)
    ``landing=False``: mooncake and nixl lend no landing, so every object is read by
    the receiver (an object in flight is one announced and not yet ACKed)."""
    sender, receiver = cluster["c"], cluster["b"]
    # partitions longer than the resume window (spec §10.7): the session ends
    common = ["--backends", f"local,shm,{engine}", "--peer-timeout", str(PEER_TIMEOUT)]
    common += ["--resume-window", str(resume_window)]  # both sides: each ends its own session
    if engine in ("mooncake", "nixl") and not landing:
        common += ["--landing-size", "0"]
    route = [] if engine == "mooncake" else ["--route", engine]
    recv = Side(receiver, "recv", "--name", "r", "--address", f"tcp://{receiver.ip}:0",
                *common)  # fmt: skip
    send = Side(sender, "send", "--name", "s", "--address", f"tcp://{sender.ip}:0",
                "--peer", f"r={recv.address}", *common, *route, *extra)  # fmt: skip
    send.expect(lambda m: m.get("ready") is True, 30)
    return send, recv, sender, receiver


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("engine", "stream"),
    [("mooncake", False), ("mooncake", True), ("nixl", False), ("nccl", False)],
    ids=["mooncake-payloads", "mooncake-stream", "nixl-payloads", "nccl-payloads"],
)
def test_a_partition_mid_transfer_fails_in_bounded_time_and_heals(
    cluster: Cluster, engine: str, stream: bool
) -> None:
    """Link down while an object is in flight (announced, read by the receiver: no
    landing): its receipt fails as lost/unresponsive within peer_timeout + a bound,
    nothing is delivered twice, the peers make a new session by themselves once the
    link is back, and later sends succeed."""
    require_backend(engine)
    cluster["c"].set_rate("200mbit")  # 16 MiB takes ~0.7 s on the wire
    extra = ["--size", str(16 << 20), "--count", "4", "--settle", "8"]
    extra += ["--stream"] if stream else []
    send, recv, sender, _ = start_pair(cluster, engine, *extra, landing=False)
    try:
        send.expect(lambda m: m.get("sent") == 1, 30)
        time.sleep(0.2)
        sender.link_down()
        down = time.monotonic()
        failed = send.expect(lambda m: m.get("i") == 1, PEER_TIMEOUT + 30)
        failed_after = time.monotonic() - down
        time.sleep(max(0.0, PEER_TIMEOUT + 1.5 - (time.monotonic() - down)))
        sender.link_up()  # down for longer than peer_timeout: both sides saw the loss
        lines = send.finish(60)
    finally:
        sender.link_up()
        cluster["c"].set_rate("1gbit")
    got = recv.finish(30)
    results = {m["i"]: m for m in lines if "i" in m and "ok" in m}
    settled = next(m["settled"] for m in lines if "settled" in m)
    assert results[0]["ok"] and results[2]["ok"] and results[3]["ok"], results
    if not failed["ok"]:  # it may also have made it across before the link went
        assert failed["error"] in ("PeerUnresponsiveError", "PeerLostError"), failed
        assert failed_after < PEER_TIMEOUT + 3, failed
        assert any("rejoined" in m for m in lines), lines
    delivered = [(m["rid"], m["i"]) for m in got if m.get("kind") in ("payload", "stream_chunk")]
    assert len(delivered) == len(set(delivered)), f"delivered twice: {delivered}"
    assert all(m["ok"] for m in got if "ok" in m), f"bytes differ: {got} {lines}"
    for i, outcome in settled.items():
        was = any(d[1] == int(i) for d in delivered)
        assert outcome in ("delivered", "unknown"), settled
        assert not (outcome == "delivered" and not was), (i, settled, delivered)
    assert {d[1] for d in delivered} >= {0, 2, 3}
    held = next(m["held"] for m in got if "end" in m)
    assert not any(held.values()), held


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("engine", "mode"),
    [("mooncake", "landed"), ("mooncake", "stream"), ("nixl", "landed"), ("nccl", "read")],
)
def test_a_blip_within_the_resume_window_fails_no_object(
    cluster: Cluster, engine: str, mode: str
) -> None:
    """A partition of 2.5 s (past the heartbeat timeout: ZeroMQ drops the connection)
    while objects are in flight, well within ``resume_window`` (spec §10.7): no
    receipt fails, every object is delivered once (a stream's chunks in order), and
    every receipt settles "delivered"."""
    require_backend(engine)
    extra = ["--size", str(4 << 20), "--count", "6", "--gap", "0.5", "--settle", "20"]
    extra += ["--ack-timeout", "30"]
    extra += ["--stream"] if mode == "stream" else []
    # the window on both sides: the receiver's own connection may come back more than
    # 1 s after the link, and with RESUME_WINDOW it ended its session (seen in 2 of 5)
    send, recv, sender, _ = start_pair(
        cluster, engine, *extra, landing=mode == "landed", resume_window=30
    )
    try:
        send.expect(lambda m: m.get("i") == 0, 30)
        sender.link_down()
        time.sleep(2.5)
        sender.link_up()
        lines = send.finish(90)
    finally:
        sender.link_up()
    got = recv.finish(30)
    results = {m["i"]: m for m in lines if "i" in m and "ok" in m}
    settled = next(m["settled"] for m in lines if "settled" in m)
    assert sorted(results) == list(range(6)), results
    assert all(m["ok"] for m in results.values()), [m for m in results.values() if not m["ok"]]
    assert set(settled.values()) == {"delivered"}, settled
    delivered = [m["i"] for m in got if m.get("kind") in ("payload", "stream_chunk")]
    assert delivered == list(range(6)), got  # once each, in order
    assert all(m["ok"] for m in got if "ok" in m), f"bytes differ: {got}"
    if mode == "landed":
        assert {m["outcome"] for m in results.values()} <= {"landed", "delivered"}
    held = next(m["held"] for m in got if "end" in m)
    assert not any(held.values()), held


@pytest.mark.timeout(120)
def test_a_receiver_restarted_under_its_name_ends_the_session_at_once(cluster: Cluster) -> None:
    """Within a 30 s resume window, a receiver SIGKILLed and started again under the
    same name and address: its new instance's Hello ends the session at once (spec
    §10.6, not the window): the object in flight fails as lost ("it restarted"),
    nothing of the old session reaches the new instance (its numbered frames carry
    the old session's token, §10.7), and later sends reach the new instance."""
    require_backend("mooncake")
    sender, receiver = cluster["c"], cluster["b"]
    cluster["c"].set_rate("200mbit")  # 16 MiB takes ~0.7 s on the wire
    address = f"tcp://{receiver.ip}:45123"
    common = ["--backends", "local,shm,mooncake", "--peer-timeout", str(PEER_TIMEOUT)]
    common += ["--resume-window", "30", "--landing-size", "0"]
    recv = Side(receiver, "recv", "--name", "r", "--address", address, *common)
    send = Side(sender, "send", "--name", "s", "--address", f"tcp://{sender.ip}:0",
                "--peer", f"r={address}", *common, "--size", str(16 << 20), "--count", "4",
                "--settle", "5", "--rejoin", "30")  # fmt: skip
    again: Side | None = None
    try:
        send.expect(lambda m: m.get("ready") is True, 30)
        send.expect(lambda m: m.get("sent") == 1, 30)
        recv.kill()
        killed = time.monotonic()
        again = Side(receiver, "recv", "--name", "r", "--address", address, *common)
        failed = send.expect(lambda m: m.get("i") == 1, 40)
        failed_after = time.monotonic() - killed
        lines = send.finish(60)
        got = again.finish(30)
    finally:
        cluster["c"].set_rate("1gbit")
        for side in (send, recv, again):
            if side is not None:
                side.kill()
    assert not failed["ok"] and failed["error"] == "PeerLostError", failed
    assert "restarted" in failed["message"], failed
    assert failed_after < 25, failed_after  # the restart, not the 30 s window
    results = {m["i"]: m for m in lines if "i" in m and "ok" in m}
    assert results[2]["ok"] and results[3]["ok"], results
    delivered = [m["i"] for m in got if m.get("kind") == "payload"]
    assert delivered == [2, 3], got  # the new instance: only what was sent to it, once
    assert all(m["ok"] for m in got if "ok" in m), f"bytes differ: {got}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("engine", ["mooncake", "nixl"])
def test_a_partition_mid_landing_fails_the_send_in_bounded_time_and_heals(
    cluster: Cluster, engine: str
) -> None:
    """Link down while an object is being written into the receiver's landing
    (push, spec §9.4, §9.5; the send call is in the write): the send fails as
    lost/unresponsive within peer_timeout + a bound, never announced, so never
    delivered; nothing is delivered twice; the peers make a new session by themselves
    once the link is back, and later sends succeed (landed, or read where the
    abandoned write's range is kept out of use)."""
    cluster["c"].set_rate("200mbit")  # 8 MiB takes ~0.35 s on the wire
    # two 8 MiB objects fit the 16 MiB landing: object 1 lands while 0 is still held
    require_backend(engine)
    extra = ["--size", str(8 << 20), "--count", "4", "--settle", "8"]
    send, recv, sender, _ = start_pair(cluster, engine, *extra)
    try:
        first = send.expect(lambda m: m.get("i") == 0, 30)
        assert first["ok"] and first["outcome"] == "landed", first
        # its announce reached the receiver (a landed receipt completes at the write:
        # on a busy machine the announce was still on its way when the link went down)
        recv.expect(lambda m: m.get("i") == 0, 30)
        sender.link_down()  # object 1's write is on the wire
        down = time.monotonic()
        failed = send.expect(lambda m: m.get("ok") is False, PEER_TIMEOUT + 30)
        failed_after = time.monotonic() - down
        time.sleep(max(0.0, PEER_TIMEOUT + 1.5 - (time.monotonic() - down)))
        sender.link_up()
        lines = send.finish(60)
    finally:
        sender.link_up()
        cluster["c"].set_rate("1gbit")
    got = recv.finish(30)
    results = {m["i"]: m for m in lines if "i" in m and "ok" in m}
    assert failed["i"] == 1, (failed, results)
    assert failed["error"] in ("PeerUnresponsiveError", "PeerLostError"), failed
    assert failed["outcome"] == "not sent" and failed_after < PEER_TIMEOUT + 3, failed
    assert any("rejoined" in m for m in lines), lines
    assert [i for i, m in sorted(results.items()) if m["ok"]] == [0, 2, 3], results
    delivered = [m["i"] for m in got if m.get("kind") == "payload"]
    assert sorted(delivered) == [0, 2, 3], got  # once each; the abandoned one never
    assert all(m["ok"] for m in got if "ok" in m), f"bytes differ: {got}"
    held = next(m["held"] for m in got if "end" in m)
    assert not any(held.values()), held


@pytest.mark.timeout(120)
def test_a_link_down_for_good_fails_everywhere_in_bounded_time(cluster: Cluster) -> None:
    """No heal: the in-flight receipt fails, the sender gives up waiting for the peer
    and closes, the receiver reports the lost request and closes; nothing hangs or
    stays behind on either host."""
    cluster["c"].set_rate("200mbit")
    extra = ["--size", str(16 << 20), "--count", "3", "--rejoin", "3", "--settle", "1"]
    send, recv, sender, receiver = start_pair(cluster, "mooncake", *extra, landing=False)
    try:
        send.expect(lambda m: m.get("sent") == 1, 30)
        time.sleep(0.2)
        sender.link_down()
        down = time.monotonic()
        failed = send.expect(lambda m: m.get("i") == 1, PEER_TIMEOUT + 30)
        assert not failed["ok"] and failed["error"] in ("PeerUnresponsiveError", "PeerLostError")
        assert time.monotonic() - down < PEER_TIMEOUT + 3, failed
        lost = recv.expect(lambda m: m.get("kind") == "error", PEER_TIMEOUT + 5)
        assert lost["rid"] == "p1", lost
        lines = send.finish(30)  # gives up after --rejoin, then closes
        assert any("gone" in m for m in lines), lines
        got = recv.finish(30)
    finally:
        sender.link_up()
        cluster["c"].set_rate("1gbit")
    assert [m["rid"] for m in got if m.get("kind") == "payload"] == ["p0"]
    assert not any(next(m["held"] for m in got if "end" in m).values())
    for host in (sender, receiver):
        assert host.pids() == [] and host.shm() == [], host


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dead", ["sender", "receiver"])
def test_all_processes_of_one_host_killed_at_once(cluster: Cluster, dead: str) -> None:
    """A host dies mid transfer (SIGKILL to everything on it): the other side fails
    what it had in flight within a bound, closes cleanly, and holds nothing."""
    cluster["c"].set_rate("200mbit")
    extra = ["--size", str(16 << 20), "--count", "3", "--rejoin", "3", "--settle", "1"]
    send, recv, sender, receiver = start_pair(cluster, "mooncake", *extra, landing=False)
    try:
        send.expect(lambda m: m.get("sent") == 1, 30)
        time.sleep(0.2)
        victim, survivor = (sender, receiver) if dead == "sender" else (receiver, sender)
        assert victim.kill_all()
        killed = time.monotonic()
        if dead == "sender":
            send.kill()
            lost = recv.expect(lambda m: m.get("kind") == "error", PEER_TIMEOUT + 5)
            assert lost["rid"] == "p1", lost
            got = recv.finish(30)
            assert not any(next(m["held"] for m in got if "end" in m).values())
        else:
            recv.kill()
            failed = send.expect(lambda m: m.get("i") == 1, PEER_TIMEOUT + 30)
            assert not failed["ok"] and "Peer" in failed["error"], failed
            lines = send.finish(30)
            assert any("gone" in m for m in lines), lines
        assert time.monotonic() - killed < PEER_TIMEOUT + 10
    finally:
        cluster["c"].set_rate("1gbit")
    assert survivor.pids() == [] and survivor.shm() == [], survivor
    for name in victim.shm():  # SIGKILL leaves the victim's own segments: nobody ran to
        assert name.startswith("omniwire-"), name  # clean them (the host is gone)
    victim.run(["sh", "-c", "rm -f /dev/shm/omniwire-*"])


@pytest.mark.timeout(120)
def test_demo_remote_across_two_namespace_hosts(cluster: Cluster) -> None:
    """``omniwire demo --remote --hosts ... --far-launch ...``: src on host a, far on
    host b, told apart by detection alone; the engines' native lines (Mooncake's
    "Local segment descriptor not found") stay off the terminal."""
    a, b = cluster["a"], cluster["b"]
    far = shlex.join(b.command(host_env(b)))
    done = a.run(
        [*host_env(a), sys.executable, "-m", "omniwire.cli", "demo", "--remote",
         "--hosts", f"{a.ip},{b.ip}", "--far-launch", far],
        timeout=100, capture_output=True, text=True, env=clean_env(),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "omniwire demo: OK" in done.stdout
    assert "src→far    payload       mooncake" in done.stdout
    assert "another host" in done.stdout
    terminal = done.stdout + done.stderr
    assert "segment descriptor" not in terminal and "InitGoogleLogging" not in terminal, terminal


@pytest.mark.timeout(120)
def test_a_partition_only_one_side_noticed_fails_in_flight_objects_at_the_heal(
    cluster: Cluster,
) -> None:
    """The receiver declares the sender lost (its peer_timeout is short), the sender
    does not (its own is long): when the link is back and the receiver says Hello
    again, the sender must learn that the receiver's session ended and fail what it
    had in flight then, not an ack_timeout later."""
    cluster["c"].set_rate("200mbit")
    extra = ["--size", str(16 << 20), "--count", "3", "--settle", "1", "--heartbeat", "0.5"]
    extra += [
        "--peer-timeout",
        "60",
        "--ack-timeout",
        "60",
        "--resume-window",
        "60",
    ]  # the sender never gives up
    send, recv, sender, _ = start_pair(cluster, "mooncake", *extra, landing=False)
    try:
        send.expect(lambda m: m.get("sent") == 1, 30)
        time.sleep(0.2)
        sender.link_down()
        recv.expect(lambda m: m.get("kind") == "error", PEER_TIMEOUT + 10)  # it noticed
        sender.link_up()
        healed = time.monotonic()
        failed = send.expect(lambda m: m.get("i") == 1, 10)
        assert time.monotonic() - healed < 10, failed
        assert not failed["ok"] and "Peer" in failed["error"], failed
    finally:
        sender.link_up()
        cluster["c"].set_rate("1gbit")
        for side in (send, recv):
            side.kill()


def test_mooncake_slices_tcp_transfers_in_whole_segments_of_a_hosts_veth(
    cluster: Cluster,
) -> None:
    """In a host whose veth has an MTU of 1500, the engine the backend starts cuts
    transfers into 45 segments of 1448 bytes (a slice ending in a short segment
    waited for the reader's delayed ACK: about 60 ms for one 1 MiB read in ten)."""
    a = cluster["a"]
    probe = (
        "import os; from omniwire.backends.mooncake._engine import shared_engine; "
        f"shared_engine({a.ip!r}, 'tcp', ''); print(os.environ['MC_TCP_SLICE_SIZE'])"
    )
    env = {k: v for k, v in clean_env().items() if k != "MC_TCP_SLICE_SIZE"}
    done = a.run([sys.executable, "-c", probe], timeout=60, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-1] == str(45 * 1448)


@pytest.mark.timeout(240)
def test_the_namespace_bench_sets_each_engine_beside_its_bare_engine_and_a_control_round_trip(
    cluster: Cluster, tmp_path: Path
) -> None:
    """``omniwire bench --namespaces``: the peers, the bare engine's other end and the
    raw zmq.asyncio peer all run in the second host (its own namespaces, made and
    removed by the bench), so every baseline crosses the same veth as omniwire;
    the control round trip (a raw zmq.asyncio round trip of a DataReady-sized
    message between the hosts) bounds each row the receiver reads (``--landing-size
    0``); rows whose objects land are set beside the bare engine's writes."""
    del cluster  # only for its skip: the bench makes its own two hosts
    before = _namespaces()
    for landing in ("16M", "0"):  # the default: objects land; 0: the receiver reads
        out = tmp_path / f"ns-{landing}.json"
        done = subprocess.run(
            [sys.executable, "-m", "omniwire.cli", "bench", "--namespaces", "--backends",
             "mooncake", "--sizes", "64K", "--iters", "5", "--json", str(out),
             "--landing-size", landing],
            timeout=220, capture_output=True, text=True, env=clean_env(),
        )  # fmt: skip
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        table = json.loads(out.read_text())["table"]
        other = re.search(r"<Host b (198\.1[89]\.[0-9.]+) ", done.stdout)
        assert other is not None, done.stdout[:500]
        assert table["zmq_peer"].startswith(f"tcp://{other.group(1)}:")
        control = table["control_rtt_us"]
        assert control > 0
        assert table["zmq_rtt_us"]["65536"] > 0
        rows = {r["mode"]: r for r in table["rows"]}
        assert set(rows) == {"copy", "lent"}
        for r in rows.values():
            assert r["raw_gbps"] > 0 and 0 < r["acked_gbps"] <= r["oneway_gbps"], r
            if landing == "0":  # read: beside the bare reads, bounded by a round trip
                assert r["landed"] == 0.0 and r["raw_op"] == "read", r
                raw_s = 65536 / (r["raw_gbps"] * 1e9)
                assert abs(r["bound"] - raw_s / (raw_s + control / 1e6)) < 1e-6
            else:  # landed (spec §9.4): beside the bare writes, no round trip in it
                assert r["landed"] == 1.0 and r["raw_op"] == "write" and r["bound"] is None, r
        assert "round trip of a control message (512 B)" in done.stdout
        assert "×raw  bound" in done.stdout
    # the bench removed the hosts it made (its process is gone: a live process's
    # hosts, another test file's under pytest-xdist, are not this test's to judge)
    assert not {n for n in _namespaces() - before if not _maker_alive(n)}


INLINE = Path(__file__).resolve().parent / "cluster_inline.py"


def _inline_partition(
    cluster: Cluster, down_s: float, resume_window: float
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Inline sends (one a millisecond, ``cluster_inline.py``) from host a to host b
    with a partition of ``down_s`` seconds in the middle: what the sender says of
    its sends and what the receiver took."""
    sender, receiver = cluster["a"], cluster["b"]
    py = sys.executable
    opts = ["--peer-timeout", "10", "--heartbeat", "0.3"]  # ZeroMQ drops a link after 0.9 s
    opts += ["--resume-window", str(resume_window)]
    recv = receiver.popen([py, str(INLINE), "recv", f"tcp://{receiver.ip}:0", "60", *opts],
                          stdout=subprocess.PIPE, text=True, env=clean_env())  # fmt: skip
    send: subprocess.Popen[str] | None = None
    try:
        assert recv.stdout is not None
        address = json.loads(recv.stdout.readline())["address"]
        send = sender.popen([py, str(INLINE), "send", f"tcp://{sender.ip}:0", address, "8", *opts],
                            stdout=subprocess.PIPE, text=True, env=clean_env())  # fmt: skip
        assert send.stdout is not None
        assert json.loads(send.stdout.readline())["ready"]
        time.sleep(2)
        sender.link_down()
        time.sleep(down_s)
        sender.link_up()
        sent = json.loads(send.stdout.readline())
        got = json.loads(recv.stdout.readline())
        assert send.wait(30) == 0 and recv.wait(30) == 0
    finally:
        sender.link_up()
        for p in (send, recv):
            if p is not None:
                if p.poll() is None:
                    p.kill()
                    p.wait()
                if p.stdout is not None:
                    p.stdout.close()
    return sent, got


@pytest.mark.timeout(90)
def test_a_blip_within_the_resume_window_costs_latency_not_data(cluster: Cluster) -> None:
    """A partition longer than the heartbeat timeout (ZeroMQ closes the connection,
    and the frames its buffers held are gone) but within ``resume_window``: the
    session resumes (spec §10.7). Every send returns and is delivered once, in
    order; no peer is declared lost. (Was: one message delivered twice — a numbered
    frame ZeroMQ could not take at once was queued again as a new frame.)"""
    sent, got = _inline_partition(cluster, 2.5, resume_window=30)
    delivered = [g for g in got["got"] if isinstance(g, int)]
    print(
        f"{len(sent['ok'])} sends returned; sender {sent['counters']}; receiver {got['counters']}"
    )
    assert len(delivered) == len(set(delivered)), "delivered twice"
    assert delivered == sorted(delivered), "out of order"
    assert sent["failed"] == [] and sent["lost_at"] == [], (sent["failed"][:5], sent["lost_at"])
    assert delivered == sent["ok"], sorted(set(sent["ok"]) ^ set(delivered))[:20]
    assert sent["counters"].get("sessions_resumed", 0) >= 1, sent["counters"]
    assert "peers_lost" not in got["counters"] and "peers_lost" not in sent["counters"]


@pytest.mark.timeout(90)
def test_a_connection_down_past_the_resume_window_loses_no_send_silently(
    cluster: Cluster,
) -> None:
    """Past ``resume_window`` the session ends: every send that returned is
    delivered, or the peer was declared lost after it (none vanishes silently), and
    the peers make a new session after the heal."""
    sent, got = _inline_partition(cluster, 2.5, resume_window=0.5)
    delivered = [g for g in got["got"] if isinstance(g, int)]
    assert len(delivered) == len(set(delivered)), "delivered twice"
    assert delivered == sorted(delivered), "out of order"
    missing = sorted(set(sent["ok"]) - set(delivered))
    last_loss = max(sent["lost_at"], default=-1)
    print(f"{len(sent['ok'])} sends returned, {len(missing)} of them not delivered; "
          f"the peer declared lost at sends {sent['lost_at']}; {sent['counters']}")  # fmt: skip
    assert sent["lost_at"], sent["counters"]  # the window expired: the session ended
    assert all(i < last_loss for i in missing), (missing[:20], sent["lost_at"], sent["counters"])
    assert sent["ok"][-1] in delivered  # the peers made a new session after the heal
