"""Every released text of the spec keeps a peer written to it (spec §12.6): the
foreign-peer kit as it stood at that text, frozen under tests/frozen/, runs its own
scenarios live against the current reference endpoint.

Each kit runs in a pytest of its own, rooted in its folder, so that its modules
(``foreign_peer``, ``wire_cddl``) and its schema are the ones of its time.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

FROZEN = pathlib.Path(__file__).parent / "frozen"
#: folder → the commit it was taken from (see its NOTE.md)
KITS = {"wire-1.1-2026-12-01": "42854bfa797fad8ff5142a93fd670bb7d0618924"}


@pytest.mark.parametrize("kit", sorted(KITS))
def test_a_frozen_peer_passes_its_scenarios(kit: str) -> None:
    folder = FROZEN / kit
    assert KITS[kit] in (folder / "NOTE.md").read_text()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-c",
            "pytest.ini",
            "--rootdir",
            ".",
            "tests/test_foreign_peer.py",
        ],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=110,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ""},
        check=False,
    )
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, f"the peer of {kit} fails against the reference:\n{tail}"
    assert " passed" in proc.stdout and "failed" not in proc.stdout, tail
