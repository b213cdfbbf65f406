"""Enable the adapter when sglang-omni's stage runtime is imported (the ``.pth`` hook).

The ``.pth`` line that ``python -m omniwire.integrations.sglang_omni install-pth``
writes imports this module at interpreter start-up, and only when
``OMNIWIRE_SGLANG_OMNI`` is set to something other than ``0``. It imports nothing of
sglang-omni itself: it waits on ``sys.meta_path`` for
``sglang_omni.pipeline.stage.runtime`` and calls ``enable()`` once that module has
loaded, in every process that builds stages (sglang-omni spawns its stage
processes, which inherit the environment).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType

TARGET = "sglang_omni.pipeline.stage.runtime"
PTH_NAME = "omniwire-sglang-omni.pth"
PTH_LINE = (
    "import os; os.environ.get('OMNIWIRE_SGLANG_OMNI', '0') not in ('', '0') "
    "and __import__('omniwire.integrations.sglang_omni._autoload')\n"
)


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader) -> None:
        self.inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        from . import _enable_on_import

        _enable_on_import(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                sys.meta_path.remove(self)  # once
                spec.loader = _Loader(spec.loader)
                return spec
        return None


def install() -> None:
    if TARGET in sys.modules:
        from . import _enable_on_import

        _enable_on_import(sys.modules[TARGET])
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


install()
