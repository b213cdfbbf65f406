"""The backend registry: entry points, lazy loading, broken plugins, programmatic registration."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata
from typing import Any, ClassVar

import pytest

from omniwire import registry
from omniwire.backends.base import (
    Availability,
    Capabilities,
    Export,
    Import,
    ObjectBackend,
    PeerInfo,
)
from omniwire.backends.shm import ShmBackend
from omniwire.errors import BackendUnavailableError
from omniwire.registry import PluginError

BUILT_INS = {"local", "shm", "cuda_ipc", "mooncake", "nccl", "nixl"}


def test_built_ins_are_declared_as_entry_points() -> None:
    eps = {ep.name: ep.value for ep in metadata.entry_points(group="omniwire.backends")}
    assert set(eps) >= BUILT_INS
    assert eps["shm"] == "omniwire.backends.shm:ShmBackend"
    entries = registry.backends()
    assert all(entries[name].source == "built-in" for name in BUILT_INS)
    with pytest.raises(TypeError):
        entries["x"] = entries["shm"]  # type: ignore[index]  # read-only view


def test_load_backend_and_status() -> None:
    assert registry.load_backend("shm") is ShmBackend
    assert registry.backend_status("shm").status == "available"
    with pytest.raises(KeyError):
        registry.load_backend("no-such-backend")


def test_import_omniwire_loads_no_engine() -> None:
    code = (
        "import sys, omniwire, omniwire.endpoint; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('mooncake', 'nixl', 'nixl_cu12', 'nixl_cu13', 'omniwire_backend_example')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


class _Unavailable(ObjectBackend):
    name: ClassVar[str] = "needs-foo"
    capabilities: ClassVar[Capabilities] = Capabilities()
    install_hint: ClassVar[str] = 'pip install "foo"'

    @classmethod
    def availability(cls) -> Availability:
        return Availability.missing("the foo library is not installed", "pip install foo")

    def export_object(self, peer: PeerInfo, value: Any) -> Export:
        raise NotImplementedError

    async def import_(self, peer: PeerInfo, ref: bytes, nbytes: int) -> Import:
        raise NotImplementedError


class _Incomplete(ObjectBackend):  # import_ is missing
    name: ClassVar[str] = "incomplete"
    capabilities: ClassVar[Capabilities] = Capabilities()

    def export_object(self, peer: PeerInfo, value: Any) -> Export:
        raise NotImplementedError


def test_unavailable_backend_reports_reason_and_hint() -> None:
    registry.register_backend("needs-foo", _Unavailable)
    try:
        entry = registry.backend_status("needs-foo")
        assert entry.status == "unavailable"
        assert entry.source == "registered in code"
        with pytest.raises(BackendUnavailableError, match=r"foo library.*pip install foo"):
            registry.load_backend("needs-foo")
        with pytest.raises(ValueError, match="already registered"):
            registry.register_backend("needs-foo", _Unavailable)
        registry.register_backend("needs-foo", _Unavailable, replace=True)
    finally:
        registry.unregister_backend("needs-foo")


def test_interface_is_checked_at_registration_naming_the_plugin() -> None:
    with pytest.raises(PluginError, match=r"incomplete.*does not implement import_"):
        registry.register_backend("incomplete", _Incomplete)  # type: ignore[type-abstract]
    with pytest.raises(PluginError, match="not a ByteBackend or ObjectBackend"):
        registry.register_backend("bogus", dict)  # type: ignore[arg-type]
    with pytest.raises(PluginError, match="name is 'needs-foo', not 'other'"):
        registry.register_backend("other", _Unavailable)


def test_a_broken_plugin_is_listed_as_broken_and_breaks_nothing(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real = metadata.entry_points
    broken = metadata.EntryPoint("broken", "omniwire_no_such_module.sub:Thing", "omniwire.backends")
    wrong = metadata.EntryPoint("wrong", "omniwire.codec:dumps", "omniwire.backends")

    def fake(**kw: Any) -> Any:
        eps = list(real(**kw))
        if kw.get("group") == "omniwire.backends":
            eps += [broken, wrong]
        return eps

    monkeypatch.setattr(registry.metadata, "entry_points", fake)
    monkeypatch.setattr(registry, "_discovered", False)
    monkeypatch.setattr(registry, "_entries", {})
    entries = registry.backends()
    assert {"broken", "wrong"} <= set(entries)
    assert registry.backend_status("broken").status == "unavailable"
    assert "omniwire_no_such_module" in registry.backend_status("broken").error
    assert registry.backend_status("wrong").status == "broken"
    with pytest.raises(PluginError, match="wrong"):
        registry.load_backend("wrong")
    assert "is not a ByteBackend" in caplog.text
    assert registry.load_backend("shm") is ShmBackend  # the rest still works


def test_policies_by_name() -> None:
    assert registry.load_policy("default").name == "default"
    assert registry.load_policy("strict").name == "strict"
    with pytest.raises(KeyError, match=r"registered: .*default"):
        registry.load_policy("nope")


def test_cli_backends_lists_every_backend_with_its_status() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "omniwire.cli", "backends"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for name in BUILT_INS | {"inline"}:
        assert any(line.startswith(name + " ") for line in out.splitlines()), (name, out)
    shm_line = next(line for line in out.splitlines() if line.startswith("shm "))
    assert "available" in shm_line and "localities=same_host" in shm_line
    cuda = next(line for line in out.splitlines() if line.startswith("cuda_ipc ")).split()
    import torch

    assert cuda[2] == ("available" if torch.cuda.is_available() else "unavailable")


def test_a_code_registration_shadows_a_built_in_until_unregistered() -> None:
    class Shadow(ShmBackend):
        pass

    registry.register_backend("shm", Shadow, replace=True)
    try:
        assert registry.load_backend("shm") is Shadow
        assert registry.backend_status("shm").source == "registered in code"
    finally:
        registry.unregister_backend("shm")
    assert registry.load_backend("shm") is ShmBackend
    assert registry.backend_status("shm").source == "built-in"
