"""A toy sglang-omni pipeline, run with sglang-omni's own relays or with omniwire's.

    python examples/sglang_omni/pipeline.py [--omniwire] [--chunk 64 --chunk 65536]

Prints one JSON line: per request, what near and far computed (digests of the
4 MiB encoder output and of each stream chunk), or the error sglang-omni reported.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def build_config(base_path: str):  # -> PipelineConfig
    from sglang_omni.config.schema import EndpointsConfig, PipelineConfig, StageConfig

    return PipelineConfig(
        model_path="toy",
        name="toy",
        entry_stage="src",
        endpoints=EndpointsConfig(base_path=base_path),
        stages=[
            StageConfig(
                name="src",
                factory_path="stages.create_src",
                next=["near", "far"],
                stream_to=["far"],
                process="main",
            ),
            StageConfig(
                name="near", factory_path="stages.create_near", terminal=True, process="main"
            ),
            StageConfig(
                name="far",
                factory_path="stages.create_far",
                terminal=True,
                process="far",
                can_accept_stream_before_payload=True,
            ),
        ],
    )


async def run(
    chunks: list[int], requests: int, timeout: float, timing: dict[str, float]
) -> dict[str, object]:
    from sglang_omni.pipeline.mp_runner import MultiProcessPipelineRunner
    from sglang_omni.proto.request import OmniRequest

    with tempfile.TemporaryDirectory(prefix="sgo-") as base:
        runner = MultiProcessPipelineRunner(build_config(base))
        t0 = time.monotonic()
        await runner.start(timeout=timeout)
        timing["start_s"] = round(time.monotonic() - t0, 2)
        results: dict[str, object] = {}
        try:
            for i in range(requests):
                rid = f"req-{i}"
                req = OmniRequest(inputs={"seed": i, "chunks": chunks})
                try:
                    out = await asyncio.wait_for(runner.coordinator.submit(rid, req), timeout)
                    results[rid] = normalize(out)
                except Exception as exc:
                    results[rid] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            timing["requests_s"] = round(time.monotonic() - t0 - timing["start_s"], 2)
        finally:
            t1 = time.monotonic()
            await runner.stop()
            timing["stop_s"] = round(time.monotonic() - t1, 2)
        return results


def normalize(out: object) -> object:
    if isinstance(out, dict):
        return {k: normalize(v) for k, v in sorted(out.items()) if k != "pid"}
    if isinstance(out, (list, tuple)):
        return [normalize(v) for v in out]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--omniwire", action="store_true", help="move stage data through omniwire")
    ap.add_argument("--chunk", type=int, action="append", default=None, help="stream chunk bytes")
    ap.add_argument("--requests", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=60.0)
    args = ap.parse_args(argv)
    os.environ["OMNIWIRE_SGLANG_OMNI"] = "1" if args.omniwire else "0"
    # sglang-omni installed beside the environment (as ``make setup`` does): appended, so
    # the environment's own packages win; spawned stage processes inherit sys.path.
    if os.environ.get("OMNIWIRE_SGLANG_OMNI_SITE"):
        sys.path.append(os.environ["OMNIWIRE_SGLANG_OMNI_SITE"])
    # The stage processes import stages.py by its dotted name.
    sys.path.insert(0, str(HERE))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    chunks = args.chunk if args.chunk is not None else [64]
    timing: dict[str, float] = {}
    results = asyncio.run(run(chunks, args.requests, args.timeout, timing))
    print(
        json.dumps(
            {"omniwire": args.omniwire, "chunks": chunks, "timing": timing, "results": results}
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
