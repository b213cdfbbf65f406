"""What an installed omniwire must hold, whichever way it was installed: ``make
test`` also runs this file from the wheel installed (not editable) in a fresh venv,
so a file missing from the wheel or a broken entry point fails there."""

from __future__ import annotations

import importlib.metadata
import pathlib
import subprocess
import sys

import omniwire
from omniwire import registry

BUILT_IN = {"local", "shm", "cuda_ipc", "mooncake", "nccl", "nixl"}


def test_the_package_ships_its_marker_and_metadata() -> None:
    package = pathlib.Path(omniwire.__file__).parent
    assert (package / "py.typed").is_file()
    dist = importlib.metadata.distribution("omniwire")
    assert dist.version == omniwire.__version__
    extras = set(dist.metadata.get_all("Provides-Extra") or [])
    assert {"test", "mooncake", "nixl", "metrics", "tracing", "bench"} <= extras


def test_every_built_in_backend_is_declared_and_loads_or_says_why() -> None:
    names = {ep.name for ep in importlib.metadata.entry_points(group=registry.BACKEND_GROUP)}
    assert names >= BUILT_IN
    for name in BUILT_IN:
        entry = registry.backend_status(name)
        assert entry.source == "built-in", entry
        assert entry.status in ("available", "unavailable"), (name, entry.error)


def test_the_console_script_runs() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "omniwire.cli", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert omniwire.__version__ in done.stdout
