"""sglang-omni stages on two namespace hosts, their data through omniwire's mooncake.

``examples/sglang_omni/two_hosts.py``: ``src`` and the coordinator on host a,
``far`` on host b, real sglang-omni 0.1.9 ``Stage``s (see tests/test_sglang_omni.py
for how it is installed and why ``sglang`` is stubbed). Needs root for the
namespaces (omniwire.testing.cluster); skipped without, failed under
OMNIWIRE_REQUIRE_ENGINES=1 when mooncake cannot load.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from omniwire.testing import require_backend
from omniwire.testing.cluster import Cluster, cluster_or_skip

ROOT = Path(__file__).resolve().parents[1]
TWO_HOSTS = ROOT / "examples" / "sglang_omni" / "two_hosts.py"
STUB = ROOT / "tests" / "sglang_cpu_stub"
SITE = Path(os.environ.get("OMNIWIRE_SGLANG_OMNI_SITE", ROOT / ".venv" / "sglang-omni"))

pytestmark = [pytest.mark.slow]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    if not (SITE / "sglang_omni").is_dir():
        reason = f"sglang-omni is not installed in {SITE} (make setup)"
        if os.environ.get("OMNIWIRE_REQUIRE_ENGINES") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    with cluster_or_skip(("a", "b")) as c:
        yield c


def env() -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if k != "OMNIWIRE_HOST_ID"}
    stub = [] if _has_sglang() else [str(STUB)]
    return {
        **base,
        "OMP_NUM_THREADS": "1",
        "MC_LOG_LEVEL": "ERROR",
        "OMNIWIRE_SGLANG_OMNI_SITE": str(SITE),
        "PYTHONPATH": os.pathsep.join(filter(None, [*stub, base.get("PYTHONPATH")])),
    }


def _has_sglang() -> bool:
    """The real ``sglang`` (not the stub another test module may have imported)."""
    import importlib.util

    spec = importlib.util.find_spec("sglang")
    return spec is not None and not str(spec.origin or "").startswith(str(STUB))


def test_stages_on_two_hosts_move_data_through_omniwire_mooncake(
    cluster: Cluster, tmp_path: Path
) -> None:
    require_backend("mooncake")
    a, b = cluster["a"], cluster["b"]
    ips = ["--src-ip", a.ip, "--far-ip", b.ip]
    far_log = tmp_path / "far.log"
    with far_log.open("w") as log:
        far = b.popen(
            [sys.executable, str(TWO_HOSTS), "far", *ips],
            env=env(),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        done = a.run(
            [sys.executable, str(TWO_HOSTS), "src", *ips, "--chunk", "64", "--chunk", "65536"],
            timeout=240,
            capture_output=True,
            text=True,
            env=env(),
        )
        assert done.returncode == 0, done.stderr[-3000:] + far_log.read_text()[-3000:]
        out = json.loads(done.stdout.strip().splitlines()[-1])
        print(out)
        assert out["backends"] == ["mooncake"], out
        for res in out["results"].values():
            assert "error" not in res, res
            assert res["stage"] == "far"
            assert [n for n, _ in res["chunks"]] == [64, 65536]
        # the same digests as on one host (test_sglang_omni's toy pipeline, seed 0)
        assert out["results"]["req-0"]["enc"] == "a64b21e3148993fa"
        assert out["results"]["req-0"]["chunks"][1][1] == "916b144867c34061"
        assert far.wait(timeout=60) == 0, far_log.read_text()[-3000:]
    finally:
        if far.poll() is None:
            far.kill()
            far.wait(timeout=30)
