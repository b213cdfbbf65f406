"""Stage factories of the toy sglang-omni pipeline (examples/sglang_omni/pipeline.py).

src --payload--> near   (same process as src)
src --payload--> far    (another process)
src --stream---> far    (a 64-byte chunk and a 64 KiB chunk, CPU tensors)

Each stage process imports this module to build its scheduler. With
OMNIWIRE_SGLANG_OMNI=1 in the environment (set by pipeline.py --omniwire) the module
turns omniwire on with the one documented line below; a module of one's own
would simply call ``enable()`` unconditionally.
"""

from __future__ import annotations

import hashlib
import os
import queue
import threading

import torch

if os.environ.get("OMNIWIRE_SGLANG_OMNI") == "1":
    import omniwire.integrations.sglang_omni

    omniwire.integrations.sglang_omni.enable()  # the one line

from sglang_omni.proto.request import StagePayload
from sglang_omni.scheduling.message import IncomingMessage, OutgoingMessage

ENCODER_BYTES = 4 * 1024 * 1024


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def make_encoder_output(seed: int, nbytes: int = ENCODER_BYTES) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(nbytes // 4, generator=g).reshape(-1, 1024)


class ThreadScheduler:
    """The smallest StageScheduler: one thread, inbox -> handle() -> outbox."""

    def __init__(self) -> None:
        self.inbox: queue.Queue[IncomingMessage] = queue.Queue()
        self.outbox: queue.Queue[OutgoingMessage] = queue.Queue()
        self._stop = threading.Event()

    def warm_up_serving_thread(self) -> None:
        pass

    def start(self) -> None:
        while not self._stop.is_set():
            msg = self.inbox.get()
            if msg.type == "wakeup":
                continue
            try:
                self.handle(msg)
            except Exception as exc:  # the stage's own failure path
                self.outbox.put(OutgoingMessage(msg.request_id, "error", data=repr(exc)))

    def stop(self) -> None:
        self._stop.set()
        self.inbox.put(IncomingMessage(request_id="", type="wakeup"))

    def abort(self, request_id: str) -> None:
        pass

    def handle(self, msg: IncomingMessage) -> None:
        raise NotImplementedError


class SourceScheduler(ThreadScheduler):
    """src: an "encoder output" of ENCODER_BYTES, and the stream chunks to far."""

    def handle(self, msg: IncomingMessage) -> None:
        if msg.type != "new_request":
            return
        payload: StagePayload = msg.data
        params = payload.request.inputs
        seed = int(params["seed"])
        nbytes = int(params.get("nbytes", ENCODER_BYTES))
        for i, size in enumerate(params.get("chunks", ())):
            chunk = torch.full((size,), (seed + i) % 251, dtype=torch.uint8)
            self.outbox.put(OutgoingMessage(payload.request_id, "stream", data=chunk, target="far"))
        enc = make_encoder_output(seed, nbytes)
        self.outbox.put(
            OutgoingMessage(
                payload.request_id,
                "result",
                data=StagePayload(
                    request_id=payload.request_id,
                    request=payload.request,
                    data={"enc": enc, "seed": seed},
                ),
            )
        )


class NearScheduler(ThreadScheduler):
    """near: a digest of the encoder output it got (same process as src)."""

    def handle(self, msg: IncomingMessage) -> None:
        if msg.type != "new_request":
            return
        payload: StagePayload = msg.data
        enc = payload.data["enc"]
        self.outbox.put(
            OutgoingMessage(
                payload.request_id,
                "result",
                data=StagePayload(
                    request_id=payload.request_id,
                    request=payload.request,
                    data={"stage": "near", "enc": digest(enc), "pid": os.getpid()},
                ),
            )
        )


class FarScheduler(ThreadScheduler):
    """far: the encoder output and the streamed chunks; answers once it has all."""

    def __init__(self) -> None:
        super().__init__()
        self.state: dict[str, dict[str, object]] = {}

    def handle(self, msg: IncomingMessage) -> None:
        st = self.state.setdefault(msg.request_id, {"chunks": [], "payload": None})
        if msg.type == "new_request":
            st["payload"] = msg.data
        elif msg.type == "stream_chunk":
            st["chunks"].append(msg.data.data)
        elif msg.type != "stream_done":
            return
        payload = st["payload"]
        if payload is None:
            return
        expected = len(payload.request.inputs.get("chunks", ()))
        if len(st["chunks"]) < expected:
            return
        del self.state[msg.request_id]
        self.outbox.put(
            OutgoingMessage(
                msg.request_id,
                "result",
                data=StagePayload(
                    request_id=payload.request_id,
                    request=payload.request,
                    data={
                        "stage": "far",
                        "enc": digest(payload.data["enc"]),
                        "chunks": [(int(c.numel()), digest(c)) for c in st["chunks"]],
                        "pid": os.getpid(),
                    },
                ),
            )
        )


def create_src() -> SourceScheduler:
    return SourceScheduler()


def create_near() -> NearScheduler:
    return NearScheduler()


def create_far() -> FarScheduler:
    return FarScheduler()
