"""The plugin follows omniwire's "Write a backend" guide (docs/backends.md), and the
guide describes the seam as it is."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
from omniwire.backends import base
from omniwire.backends.pool import SlotPool

from omniwire_backend_example import TcpBackend
from omniwire_backend_example import _backend as plugin

GUIDE = Path(__file__).resolve().parents[3] / "docs" / "backends.md"


@pytest.fixture(scope="module")
def guide() -> str:
    if not GUIDE.exists():
        pytest.fail(f"the guide {GUIDE} is missing")
    return GUIDE.read_text()


def _table_names(text: str) -> set[str]:
    """The method and member names in the guide's tables (each row's first code span)."""
    names = set()
    for row in re.findall(r"^\|([^\n]*)\|$", text, flags=re.M):
        m = re.search(r"`([A-Za-z_][A-Za-z_0-9]*)", row)
        if m:
            names.add(m.group(1))
    return names


def test_every_method_the_guide_names_exists_in_the_seam(guide: str) -> None:
    names = _table_names(guide)
    owners = (base.ByteBackend, base.Export, base.Import)
    for name in ("export", "import_", "publish", "fetch", "hello", "detail", "_release"):
        assert name in names, f"the guide does not mention {name}"
    for name in names:
        assert any(
            hasattr(cls, name) or f"self.{name} =" in inspect.getsource(cls.__init__)
            for cls in owners
        ), f"{name} is not part of the seam"


def test_the_plugin_implements_what_the_guide_asks(guide: str) -> None:
    assert issubclass(TcpBackend, base.ByteBackend) and not inspect.isabstract(TcpBackend)
    for attr in ("name", "capabilities", "summary", "install_hint"):
        assert attr in TcpBackend.__dict__, f"TcpBackend does not declare {attr}"
    for method in (
        "start",
        "hello",
        "connect",
        "disconnect",
        "aclose",
        "detail",
        "export",
        "import_",
    ):
        assert method in TcpBackend.__dict__, f"TcpBackend does not define {method}"
    assert issubclass(plugin._TcpExport, base.Export)
    assert {"ref", "publish", "_release"} <= set(plugin._TcpExport.__dict__)
    assert issubclass(plugin._TcpImport, base.Import) and "fetch" in plugin._TcpImport.__dict__


def test_the_plugin_uses_the_shared_pool_and_maps_errors(guide: str) -> None:
    assert "SlotPool" in guide and "map_errors" in guide and "poll_until" in guide
    source = inspect.getsource(plugin)
    assert "SlotPool" in source and "BuddyAllocator" not in source
    assert isinstance(TcpBackend(base.BackendContext("x", 1)).pool, SlotPool)
    assert "import pickle" not in source


def test_the_guide_shows_the_entry_point_the_plugin_declares(guide: str) -> None:
    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    line = 'example_tcp = "omniwire_backend_example:TcpBackend"'
    assert line in guide and line in pyproject
