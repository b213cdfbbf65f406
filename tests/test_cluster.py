"""Many hosts on one machine: network namespaces as hosts (``omniwire.testing.cluster``).

Every endpoint runs in a namespace host with its own network stack, address and
/dev/shm; host identity comes from detection alone (no ``OMNIWIRE_HOST_ID``).
The pipeline example runs across hosts over each cross-host engine, and with one
stage pair sharing a host. Needs root: fails rather than skips under
``OMNIWIRE_REQUIRE_ENGINES=1``.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from omniwire.testing import require_backend
from omniwire.testing.cluster import Cluster, Host, cluster_or_skip

RUN = Path(__file__).resolve().parents[1] / "examples" / "pipeline" / "run.py"
pytestmark = [pytest.mark.slow]


def host_env(host: Host) -> list[str]:
    """The per-host engine settings: UCX and gloo bind to the host's veth."""
    return ["env", f"UCX_NET_DEVICES={host.ifname}", f"GLOO_SOCKET_IFNAME={host.ifname}"]


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMNIWIRE_HOST_ID", "UCX_NET_DEVICES")}
    return {**env, "OMP_NUM_THREADS": "1", "MC_LOG_LEVEL": "ERROR"}


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
        args += ["--bind", f"{stage}=tcp://{host.ip}:0"]
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
