"""The four changes ``enable()`` makes to sglang-omni, and their undoing."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch

from ._compat import SglangOmniNames
from ._wire import StageWire, endpoint_options, omniwire_address, wire_for

log = logging.getLogger("omniwire.integrations.sglang_omni")

__all__ = ["apply", "revert"]


def _relay_names() -> tuple[str, ...]:
    names: tuple[str, ...] = ("shm", "mooncake")
    if torch.cuda.is_available():
        names += ("cuda_ipc",)
    return names


def apply(names: SglangOmniNames) -> dict[str, Any]:
    from . import _relay_class

    saved: dict[str, Any] = {}
    registry = names.relay_base.RELAY_REGISTRY
    for name in _relay_names():
        saved[f"registry:{name}"] = registry.get(name)
        cls = _relay_class(name)
        if name == "cuda_ipc":  # its paged-KV methods stay sglang-omni's own
            from sglang_omni.relay.cuda_ipc import CudaIpcRelay

            cls.fallback = CudaIpcRelay
        registry[name] = cls

    router_cls, engine_cls, stage_cls = names.router_cls, names.engine_cls, names.stage_cls
    kinds = names.transport_kind
    orig_stream = router_cls.outbound_stream
    orig_cleanup = engine_cls.cleanup
    orig_start = stage_cls.start
    orig_stop = stage_cls.stop
    saved.update(stream=orig_stream, cleanup=orig_cleanup, start=orig_start, stop=orig_stop)

    def outbound_stream(self: Any, target: str, data: torch.Tensor) -> Any:
        # sglang-omni 0.1.9 raises ValueError for a chunk on the platform's own
        # device type to a target that is not a GPU stage (on a CPU machine: every
        # CPU chunk over 16 KiB). Such a chunk goes by shm, as payloads do.
        if (
            isinstance(data, torch.Tensor)
            and target not in self.remote_stage_names
            and not (self.gpu_id is not None and target in self.gpu_stage_names)
        ):
            return self.note_transport("stream", target, kinds.SHM)
        return orig_stream(self, target, data)

    def cleanup(self: Any, request_id: str) -> None:
        orig_cleanup(self, request_id)
        done: set[str] = set()  # the stage's relays share one endpoint: abort once
        for relay in list(self.router.relays.values()):
            abort = getattr(relay, "abort", None)
            eid = getattr(relay, "engine_id", None)
            if abort is not None and isinstance(eid, str) and eid not in done:
                done.add(eid)
                # RuntimeError: no running loop, so nothing of it is in flight here
                with contextlib.suppress(RuntimeError):
                    abort(request_id, reason="sglang-omni cleanup")

    async def start(self: Any) -> None:
        await attach(self, names)
        try:
            await orig_start(self)
        except BaseException:
            await detach(self)
            raise

    async def stop(self: Any) -> None:
        try:
            await orig_stop(self)
        finally:
            await detach(self)

    router_cls.outbound_stream = outbound_stream
    engine_cls.cleanup = cleanup
    stage_cls.start = start
    stage_cls.stop = stop
    return saved


def revert(names: SglangOmniNames, saved: dict[str, Any]) -> None:
    registry = names.relay_base.RELAY_REGISTRY
    for key, value in saved.items():
        if key.startswith("registry:"):
            name = key.split(":", 1)[1]
            if value is None:
                registry.pop(name, None)
            else:
                registry[name] = value
    names.router_cls.outbound_stream = saved["stream"]
    names.engine_cls.cleanup = saved["cleanup"]
    names.stage_cls.start = saved["start"]
    names.stage_cls.stop = saved["stop"]


def engine_id(router: Any) -> str:
    cfg = router.comm_config
    return str(cfg["worker_id"]) if "worker_id" in cfg else f"{router.stage_name}_relay"


async def attach(stage: Any, names: SglangOmniNames) -> None:
    """Start the stage's omniwire endpoint, introduce its peers, create its relays."""
    from ...endpoint import Endpoint

    router = stage.comm.router
    eid = engine_id(router)
    if wire_for(eid) is not None or stage.name not in stage.endpoints:
        return
    kinds = names.transport_kind
    own = set(stage.same_process_targets) | {stage.name}
    peers = {
        name: omniwire_address(addr)
        for name, addr in stage.endpoints.items()
        if name not in own and isinstance(addr, str) and addr.startswith(("ipc://", "tcp://"))
    }
    remote = bool(router.remote_stage_names)
    opts = endpoint_options(gpu=router.gpu_id is not None, remote=remote)
    ep = Endpoint(
        stage.name, address=omniwire_address(stage.endpoints[stage.name]), peers=peers, **opts
    )
    wire = StageWire(ep, eid)
    await wire.start()
    # Create the relays now, not on the first transfer.
    wanted = [kinds.SHM]
    if remote:
        wanted.append(kinds.MOONCAKE)
    if router.gpu_id is not None and torch.cuda.is_available():
        wanted.append(kinds.CUDA_IPC)
    for kind in wanted:
        router.relay(kind)
    log.debug("stage %s: omniwire endpoint %s, peers %s", stage.name, ep.address, sorted(peers))


async def detach(stage: Any) -> None:
    wire = wire_for(engine_id(stage.comm.router))
    if isinstance(wire, StageWire):
        await wire.aclose()
