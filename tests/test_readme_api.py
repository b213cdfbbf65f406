"""The README's API reference covers the whole public API (checked here, so CI
fails when a public name is added without documentation)."""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path
from types import ModuleType

import pytest

from omniwire import errors, observe, routing
from omniwire.delivery import Delivery, SendReceipt
from omniwire.endpoint import DeliveryStream, Endpoint

README = Path(__file__).resolve().parents[1] / "README.md"


def api_section() -> str:
    text = README.read_text()
    start = text.index("## API reference")
    return text[start : text.index("\n## ", start + 1)]


def public(cls: type) -> set[str]:
    names = {n for n in dir(cls) if not n.startswith("_")}
    if dataclasses.is_dataclass(cls):
        names |= {f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")}
    return names


def documented(name: str, text: str) -> bool:
    return re.search(rf"(?<!\w){re.escape(name)}\b", text) is not None


@pytest.mark.parametrize("cls", [Endpoint, Delivery, SendReceipt, DeliveryStream])
def test_every_public_member_is_in_the_api_reference(cls: type) -> None:
    text = api_section()
    instance_attrs = {
        Endpoint: {"counters"},
        SendReceipt: {"peer", "request_id", "object_id", "backend", "nbytes", "started",
                      "finished", "error"},
        DeliveryStream: {"request_id", "from_stage"},
    }.get(cls, set())  # fmt: skip
    missing = sorted(n for n in public(cls) | instance_attrs if not documented(n, text))
    assert not missing, f"{cls.__name__}: not in the README's API reference: {missing}"
    # and every parameter of the constructor and of each public method
    for name, fn in inspect.getmembers(cls, inspect.isfunction):
        if name.startswith("_") and name != "__init__":
            continue
        params = [p for p in inspect.signature(fn).parameters if p != "self"]
        if cls in (Delivery, DeliveryStream) and name == "__init__":
            continue  # fields checked above; streams are made by the endpoint
        gone = [p for p in params if not documented(p, text)]
        assert not gone, f"{cls.__name__}.{name}: parameters not documented: {gone}"


@pytest.mark.parametrize("module", [errors, observe, routing])
def test_every_exported_name_is_in_the_api_reference(module: ModuleType) -> None:
    text = api_section()
    skip = {
        "INLINE",
        "INLINE_ANY",
        "Candidate",
        "Edge",
        "PayloadInfo",
        "check_fit",
        "SendKind",
        "as_observer",
    }
    names = [n for n in module.__all__ if n not in skip]
    missing = [n for n in names if not documented(n, text)]
    assert not missing, f"{module.__name__}: not in the API reference: {missing}"
