"""``OmniwireRelay``: an sglang-omni ``Relay`` whose bytes move through omniwire.

Registered under the names sglang-omni's ``CommRouter`` asks for (``shm``,
``mooncake``, and ``cuda_ipc`` where CUDA is available). What each call does:

- ``put_async(tensor, request_id, receiver_id=stage)``: a tensor of at most
  ``inline_max`` bytes (``OMNIWIRE_SGLANG_INLINE_MAX``, default 32 KiB) travels
  inside the returned metadata, so inside sglang-omni's own ``DataReady``: no
  segment, no omniwire frame, no second round trip. A larger one is sent now
  with ``Endpoint.send`` to the receiving stage's endpoint (shm arena on one host,
  mooncake/nixl across hosts, cuda_ipc between GPUs); the metadata carries its
  key and the sender's name and address.
- ``get_async(metadata, dest)``: copies the inline bytes, or waits for the
  omniwire delivery with that key, copies it into ``dest`` and releases it (the
  omniwire ACK, which frees the sender's slot).
- the sender's operation completes when omniwire's receipt does; sglang-omni's
  ``DataAck`` still travels as before (it drives sglang-omni's own bookkeeping).
- ``abort(request_id)`` (the adapter calls it from ``CommEngine.cleanup``, i.e.
  on sglang-omni's abort and failure paths) is ``Endpoint.abort``: pending sends
  fail, buffers are released on both sides. ``cleanup(request_id)`` itself does
  nothing: sglang-omni also calls it after every successful payload read
  (``stage_io.read_payload``), where the request's other objects are still live.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import uuid
from collections.abc import Mapping
from itertools import count
from typing import Any

import numpy as np
import torch
from sglang_omni.relay.base import Relay, RelayOperation

from ...errors import OmniwireError, RequestAbortedError
from ._wire import StageWire, wire_for

__all__ = ["OmniwireRelay"]

log = logging.getLogger("omniwire.integrations.sglang_omni")

_KEYS = count()
_PROCESS = uuid.uuid4().hex[:8]


def inline_max() -> int:
    return int(os.environ.get("OMNIWIRE_SGLANG_INLINE_MAX", str(32 << 10)))


def omniwire_request_id(request_id: str | None, key: str) -> str:
    """The omniwire request an object belongs to: sglang-omni's request id.

    sglang-omni passes the request id for payloads and the stream object id
    (``{request_id}:stream:...``) for stream chunks; both map to the request, so
    that one abort releases all of them.
    """
    if not request_id:
        return key
    return request_id.split(":stream:", 1)[0]


class _DoneOperation(RelayOperation):  # type: ignore[misc]
    """An inline put, or a get already complete: nothing to wait for."""

    def __init__(self, metadata: Mapping[str, object]) -> None:
        self._meta = metadata

    @property
    def metadata(self) -> Mapping[str, object]:
        return self._meta

    async def wait_for_completion(self, timeout: float = 30.0) -> None:
        return None

    def mark_receiver_done(self) -> None:
        return None

    def mark_receiver_failed(self, exc: BaseException) -> None:
        return None


class _SendOperation(_DoneOperation):
    """A put through omniwire: complete when the receiver's omniwire ACK came."""

    def __init__(
        self, metadata: Mapping[str, object], receipt: Any, relay: OmniwireRelay, rid: str
    ) -> None:
        super().__init__(metadata)
        self.receipt = receipt
        self.relay = relay
        self.rid = rid
        self.receiver_failed: BaseException | None = None

    async def wait_for_completion(self, timeout: float = 30.0) -> None:
        try:
            await asyncio.wait_for(self.receipt.wait(), timeout)
        except RequestAbortedError:
            return  # sglang-omni aborted the request itself; its buffers are released
        except asyncio.TimeoutError as exc:
            self.relay.abort(self.rid, reason="ack timeout")
            raise TimeoutError(
                f"omniwire object of request {self.rid!r} was not consumed within {timeout} s"
            ) from exc
        except Exception:
            if self.receiver_failed is not None:
                return  # the receiver already reported this failure through DataAck
            raise

    def mark_receiver_failed(self, exc: BaseException) -> None:
        # The receiver reported a failed read: it will never release this object.
        self.receiver_failed = exc
        self.relay.abort(self.rid, reason=f"receiver failed: {exc}")


class _GetOperation(_DoneOperation):
    """A get of an object sent through omniwire: waits for it, copies, releases."""

    def __init__(
        self,
        metadata: Mapping[str, object],
        wire: StageWire,
        key: str,
        rid: str,
        dest: torch.Tensor,
        size: int,
    ) -> None:
        super().__init__(metadata)
        self.wire = wire
        self.key = key
        self.rid = rid
        self.dest = dest
        self.size = size
        self.done = False

    async def wait_for_completion(self, timeout: float = 30.0) -> None:
        if self.done:
            return
        d = await self.wire.take(self.key, self.rid, timeout)
        try:
            src = d.payload
            if not isinstance(src, torch.Tensor):
                raise OmniwireError(f"omniwire object {self.key!r} is not a tensor")
            src = src.reshape(-1).view(torch.uint8)
            dst = self.dest.view(torch.uint8).reshape(-1)
            if dst.numel() < self.size or src.numel() < self.size:
                raise OmniwireError(
                    f"omniwire object {self.key!r}: {src.numel()} bytes for a {dst.numel()}-byte "
                    f"destination, {self.size} expected"
                )
            dst[: self.size].copy_(src[: self.size])
        finally:
            d.release()
            self.done = True


class OmniwireRelay(Relay):  # type: ignore[misc]
    """sglang-omni's ``Relay`` interface over one stage's omniwire endpoint."""

    #: the sglang-omni registry name it was created under (shm, mooncake, cuda_ipc)
    kind = "shm"

    #: sglang-omni's own relay class for this name, for what omniwire does not carry
    #: (cuda_ipc's paged-KV methods): built on first use of such a method.
    fallback: type | None = None

    def __init__(self, engine_id: str, device: str = "cpu", **options: object) -> None:
        self.engine_id = engine_id
        self.device = device
        self.closed = False
        self._options = {"engine_id": engine_id, "device": device, **options}
        self._fallback: Any = None

    def __getattr__(self, name: str) -> Any:
        # Only called for names this class lacks (register_kv_pool, put_kv_pages, ...).
        cls = type(self).fallback
        if cls is None or name.startswith("__") or name in ("_options", "_fallback"):
            raise AttributeError(name)
        if self._fallback is None:
            self._fallback = cls(**self._options)
        return getattr(self._fallback, name)

    @property
    def wire(self) -> StageWire:
        wire = wire_for(self.engine_id)
        if wire is None:
            raise OmniwireError(
                f"the omniwire relay {self.engine_id!r} has no endpoint: its stage was not "
                "started by sglang_omni's Stage.start after omniwire.integrations.sglang_omni.enable()"
            )
        return wire

    async def put_async(
        self,
        tensor: torch.Tensor,
        request_id: str | None = None,
        dst_rank: int | None = None,
        receiver_id: str | None = None,
    ) -> RelayOperation:
        nbytes = tensor.numel() * tensor.element_size()
        key = f"{_PROCESS}:{self.engine_id}:{next(_KEYS)}"
        rid = omniwire_request_id(request_id, key)
        if nbytes <= inline_max() and tensor.device.type == "cpu":
            raw = tensor.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
            return _DoneOperation(
                {"engine_id": self.engine_id, "transfer_info": {"size": nbytes, "inline": raw}}
            )
        if receiver_id is None:
            raise OmniwireError(
                f"relay {self.engine_id!r}: put_async without receiver_id cannot be routed by omniwire"
            )
        wire = self.wire
        receipt = await wire.ep.send(receiver_id, tensor, request_id=rid, metadata={"k": key})
        meta = {
            "engine_id": self.engine_id,
            "transfer_info": {
                "size": nbytes,
                "key": key,
                "rid": rid,
                "from": wire.name,
                "address": wire.ep.address,
            },
        }
        return _SendOperation(meta, receipt, self, rid)

    async def get_async(
        self,
        metadata: Mapping[str, object],
        dest_tensor: torch.Tensor,
        request_id: str | None = None,
    ) -> RelayOperation:
        info = metadata["transfer_info"]
        if not isinstance(info, Mapping):
            raise OmniwireError(f"relay {self.engine_id!r}: transfer_info is not a mapping")
        size = int(info["size"])
        raw = info.get("inline")
        if raw is not None:
            if not isinstance(raw, bytes) or len(raw) != size:
                raise OmniwireError(
                    f"relay {self.engine_id!r}: inline bytes do not match size {size}"
                )
            dst = dest_tensor.view(torch.uint8).reshape(-1)
            if dst.device.type == "cpu":
                dst.numpy()[:size] = np.frombuffer(raw, dtype=np.uint8)
            else:
                dst[:size].copy_(torch.tensor(bytearray(raw), dtype=torch.uint8))
            return _DoneOperation(metadata)
        key = str(info["key"])
        rid = str(info.get("rid") or omniwire_request_id(request_id, key))
        wire = self.wire
        sender, address = info.get("from"), info.get("address")
        if (
            isinstance(sender, str)
            and isinstance(address, str)
            and sender not in wire.ep.peer_names()
        ):
            # A sender this stage was not introduced to (another host, say): connect
            # back, so aborts and peer loss travel both ways.
            with contextlib.suppress(OmniwireError):
                wire.ep.add_peer(sender, address)
        return _GetOperation(metadata, wire, key, rid, dest_tensor, size)

    def abort(self, request_id: str, reason: str = "") -> None:
        """Abort ``request_id`` in omniwire (both sides release its buffers)."""
        wire = wire_for(self.engine_id)
        if wire is None or wire.closed:
            return
        rid = omniwire_request_id(request_id, request_id)
        wire.fail_request(
            rid, RequestAbortedError(f"request {rid!r} aborted: {reason or 'cleanup'}")
        )
        loop = asyncio.get_running_loop()
        task = loop.create_task(wire.ep.abort(rid, reason=reason or "sglang-omni cleanup"))
        task.add_done_callback(_log_failure)

    def cleanup(self, request_id: str) -> None:
        # See the module docstring: sglang-omni calls this after every payload read
        # too; the adapter aborts from CommEngine.cleanup instead.
        return None

    def close(self) -> None:
        self.closed = True
        if self._fallback is not None:
            self._fallback.close()


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("omniwire abort failed: %s", task.exception())
