"""What an installed omniwire must hold, whichever way it was installed: ``make
test`` also runs this file from the wheel installed (not editable) in a fresh venv,
so a file missing from the wheel or a broken entry point fails there."""

from __future__ import annotations

import ast
import importlib.metadata
import pathlib
import re
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


# --- every import is declared -------------------------------------------------------

# Where an import of a module outside the base dependencies is allowed, and which
# extra must provide it: a file (or a folder, ending in "/") of the package -> extras.
# Everything else omniwire imports must be in [project] dependencies.
GUARDED_BY = {
    "observe/_prometheus.py": ("metrics",),
    "observe/_tracing.py": ("tracing",),
    "bench/": ("bench",),
    "testing/": ("test",),
    "backends/mooncake/": ("mooncake", "mooncake-cuda"),
    "backends/nixl/": ("nixl",),
    "integrations/sglang_omni/": ("sglang-omni",),
    "integrations/sglang_omni.py": ("sglang-omni",),
}
# Import names of engines that may be missing where this runs (another platform),
# so that packages_distributions() cannot map them: import name -> distributions.
NOT_ALWAYS_INSTALLED = {
    "mooncake": ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine"),
    "nixl": ("nixl", "nixl-cu12", "nixl-cu13"),
    "nixl_cu12": ("nixl-cu12",),
    "nixl_cu13": ("nixl-cu13",),
    "sglang_omni": ("sglang-omni",),  # `make setup` puts it beside the venv (--target)
}


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _declared() -> tuple[set[str], dict[str, set[str]]]:
    """(base dependencies, {extra: its dependencies}), as canonical distribution names,
    from pyproject.toml where it is beside the tests, else the installed metadata."""
    pyproject = pathlib.Path(__file__).resolve().parents[1] / "pyproject.toml"
    name_of = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")
    try:
        import tomllib
    except ImportError:  # Python 3.10: the wheel's own metadata says the same
        tomllib = None  # type: ignore[assignment]
    if tomllib is not None and pyproject.is_file():
        project = tomllib.loads(pyproject.read_text())["project"]
        base = {_canonical(name_of.match(r)[1]) for r in project["dependencies"]}  # type: ignore[index]
        extras = {
            extra: {_canonical(name_of.match(r)[1]) for r in reqs}  # type: ignore[index]
            for extra, reqs in project["optional-dependencies"].items()
        }
        return base, extras
    base, extras = set(), {}
    for req in importlib.metadata.requires("omniwire") or []:
        dist = _canonical(name_of.match(req)[1])  # type: ignore[index]
        marker = re.search(r"extra\s*==\s*['\"]([^'\"]+)['\"]", req)
        if marker:
            extras.setdefault(marker[1], set()).add(dist)
        else:
            base.add(dist)
    return base, extras


def _imports(source: str) -> list[tuple[int, str]]:
    """(line, top-level module) for each absolute import in a module, wherever it is
    (module level, a function, a ``try``, ``if TYPE_CHECKING``): ``import x``,
    ``from x import y`` and ``importlib.import_module("x")`` with a literal name."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, (ast.Attribute, ast.Name))
            and (getattr(node.func, "attr", None) or getattr(node.func, "id", None))
            in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and not node.args[0].value.startswith(".")
        ):
            names = [node.args[0].value]
        found.extend((node.lineno, name.split(".")[0]) for name in names)  # type: ignore[attr-defined]
    return sorted(found)


def test_every_third_party_import_is_declared_in_the_dependencies_or_its_extra() -> None:
    """A module omniwire imports comes from a distribution in ``dependencies``; one
    only some installs have is imported only where an extra guards it (GUARDED_BY),
    from a distribution of that extra. (A plain ``pip install omniwire`` once died with
    ``No module named 'sniffio'``: anyio stopped bringing it.)"""
    base, extras = _declared()
    package = pathlib.Path(omniwire.__file__).parent
    distributions = importlib.metadata.packages_distributions()
    stdlib = set(sys.stdlib_module_names)
    problems = []
    scanned = 0
    for path in sorted(package.rglob("*.py")):
        relative = path.relative_to(package).as_posix()
        scanned += 1
        for line, top in _imports(path.read_text(encoding="utf-8")):
            if top in stdlib or top == "omniwire" or top == "__future__":
                continue
            provided_by = {
                _canonical(d) for d in distributions.get(top, NOT_ALWAYS_INSTALLED.get(top, ()))
            }
            where = f"{relative}:{line}: import {top}"
            if not provided_by:
                problems.append(f"{where}: no installed distribution provides it")
                continue
            if provided_by & base:
                continue
            guards = [
                extra
                for prefix, names in GUARDED_BY.items()
                if relative == prefix or (prefix.endswith("/") and relative.startswith(prefix))
                for extra in names
            ]
            if not guards:
                problems.append(
                    f"{where}: from {sorted(provided_by)}, not in [project] dependencies"
                )
            elif not any(provided_by & extras.get(extra, set()) for extra in guards):
                problems.append(
                    f"{where}: from {sorted(provided_by)}, not in the extra guarding it {guards}"
                )
    assert scanned > 50, f"only {scanned} modules found under {package}"
    assert not problems, "undeclared imports:\n" + "\n".join(problems)


def test_the_import_scan_sees_every_kind_of_import() -> None:
    source = (
        "import a.b\nfrom c import d\nimport importlib\n"
        "try:\n    import e\nexcept ImportError:\n    pass\n"
        "def f():\n    import g\n    importlib.import_module('h.i')\n"
        "from . import j\n"
    )
    assert _imports(source) == [
        (1, "a"),
        (2, "c"),
        (3, "importlib"),
        (5, "e"),
        (9, "g"),
        (10, "h"),
    ]
