"""What a plain ``pip install omniwire`` (no extras) must do, run from that install.

``make package`` installs the built wheel with no extras into a venv of its own and
runs this script with that venv's python (from ``build/``, so the source tree is not
on ``sys.path``). It checks:

1. omniwire is imported from the install, not from the source tree;
2. every module of the package imports, except the few an extra guards
   (``EXTRA_ONLY``), which may fail only with ``ModuleNotFoundError`` for a module
   of that extra;
3. two processes send and receive: a 4 MiB tensor payload (shm), a small dict
   (inline), a stream of three chunks and its end; the child replies with what it
   got and the parent checks it against its own figures.

Exit status 0 when all holds; the output names what did not.

    python scripts/installed_smoke.py            # the parent (starts the child)
    python scripts/installed_smoke.py --child A  # the child, dialling the parent at A
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys
import tempfile
import traceback

# Modules an extra guards -> the top-level modules they may miss without it.
EXTRA_ONLY = {
    "omniwire.observe._prometheus": {"prometheus_client"},  # metrics
    "omniwire.observe._tracing": {"opentelemetry"},  # tracing
    "omniwire.testing": {"pytest", "hypothesis"},  # test
    "omniwire.integrations": None,  # sglang-omni: whatever sglang-omni brings
}
TIMEOUT_S = 60


def check_imports() -> list[str]:
    import omniwire

    problems = []
    where = os.path.dirname(omniwire.__file__)
    if "site-packages" not in where:
        problems.append(f"omniwire imported from {where}, not from an installed wheel")
    # walk_packages imports each package to list its modules (a failure there is
    # reported below, when the package is imported again); __main__ modules run.
    walked = pkgutil.walk_packages(omniwire.__path__, "omniwire.", onerror=lambda name: None)
    names = ["omniwire"] + [m.name for m in walked if not m.name.endswith(".__main__")]
    skipped = []
    for name in names:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:
            missing = (exc.name or "").split(".")[0]
            allowed = [
                extra
                for prefix, extra in EXTRA_ONLY.items()
                if name == prefix or name.startswith(prefix + ".")
            ]
            if allowed and (allowed[0] is None or missing in allowed[0]) and missing != "omniwire":
                skipped.append(f"{name} (needs {missing})")
            else:
                problems.append(f"import {name}: {exc!r}")
        except Exception as exc:
            problems.append(f"import {name}: {exc!r}")
    bare = len(names) - len(skipped) - len(problems)
    print(f"imports: {bare} of {len(names)} modules import with no extra installed")
    for s in skipped:
        print(f"  extra-only: {s}")
    return problems


async def parent() -> list[str]:
    import anyio
    import torch

    from omniwire import Endpoint

    problems: list[str] = []
    tmp = tempfile.mkdtemp(prefix="ow-smoke-")
    address = f"ipc://{tmp}/a"
    hidden = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB: the shm backend
    chunks = [torch.full((n,), float(i)) for i, n in enumerate((16, 16 << 10, 1 << 18))]
    with anyio.fail_after(TIMEOUT_S):
        async with Endpoint("a", address=address) as ep:
            child = await anyio.open_process(
                [sys.executable, __file__, "--child", address],
                stdout=None,
                stderr=None,
            )
            async with child, ep.deliveries(request_id="r0") as replies:
                await ep.wait_peer("b", TIMEOUT_S)
                backends = []
                r = await ep.send("b", {"hidden": hidden, "step": 1}, request_id="r0")
                await r.wait(TIMEOUT_S)
                r = await ep.send("b", {"small": [1, 2, 3]}, request_id="r0")
                await r.wait(TIMEOUT_S)
                for i, chunk in enumerate(chunks):
                    await ep.stream("b", chunk, request_id="r0", metadata={"i": i})
                await ep.end_stream("b", request_id="r0")
                async for d in replies:
                    if d.kind != "payload":
                        problems.append(f"reply: {d.kind} {d.error}")
                        break
                    got = d.payload
                    backends = got["backends"]
                    want = {
                        "hidden_sum": float(hidden.double().sum()),
                        "small": [1, 2, 3],
                        "chunks": [[i, c.numel()] for i, c in enumerate(chunks)],
                    }
                    for key, value in want.items():
                        if got[key] != value:
                            problems.append(f"{key}: the child got {got[key]!r}, sent {value!r}")
                    break
                code = await child.wait()
                if code != 0:
                    problems.append(f"the child exited with {code}")
    print(f"two processes: payload, inline payload and a 3-chunk stream via {backends}")
    return problems


async def child(address: str) -> None:
    import anyio

    from omniwire import Endpoint

    tmp = tempfile.mkdtemp(prefix="ow-smoke-")
    with anyio.fail_after(TIMEOUT_S):
        async with Endpoint("b", address=f"ipc://{tmp}/b", peers={"a": address}) as ep:
            got: dict[str, object] = {"chunks": [], "backends": []}
            async for d in ep:
                got["backends"].append(f"{d.kind}:{d.backend}")  # type: ignore[attr-defined]
                if d.kind == "payload" and "hidden" in d.payload:
                    got["hidden_sum"] = float(d.payload["hidden"].double().sum())
                elif d.kind == "payload":
                    got["small"] = d.payload["small"]
                elif d.kind == "stream_chunk":
                    got["chunks"].append([d.metadata["i"], d.payload.numel()])  # type: ignore[attr-defined]
                elif d.kind == "stream_end":
                    await (await d.reply(got)).wait(TIMEOUT_S)
                    break
                else:
                    raise SystemExit(f"unexpected delivery {d.kind}: {d.error}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--child", metavar="ADDRESS")
    args = p.parse_args()
    import anyio

    if args.child:
        anyio.run(child, args.child)
        return 0
    problems = check_imports()
    try:
        problems += anyio.run(parent)
    except Exception as exc:  # an import the checks above missed, a timeout, ...
        traceback.print_exc()
        problems.append(f"two processes: {exc!r}")
    for problem in problems:
        print(f"installed_smoke: FAILED: {problem}", file=sys.stderr)
    if not problems:
        print("installed_smoke: OK")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
