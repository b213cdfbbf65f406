"""``omniwire demo`` reads well: steady-state latencies that say so, a quiet stderr."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_demo_shows_steady_state_latencies_and_keeps_stderr_quiet() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "omniwire.cli", "demo"],
        capture_output=True,
        text=True,
        timeout=200,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "omniwire demo: OK" in done.stdout
    assert "median over 5 rounds after 1 warm-up round" in done.stdout
    rows = [line for line in done.stdout.splitlines() if "→" in line and " ms" in line]
    assert rows and all(line.split()[3] == "5" or "stream_chunk" in line for line in rows), rows
    assert done.stderr == ""
