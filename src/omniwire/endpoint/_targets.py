"""Where a send goes: to one target (the :class:`~._sender.Sender`) or to several
(a :class:`~._fanout.FanOut`), inside the observer's span when the endpoint has one
(the span's trace context travels in the message)."""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from typing import Any

from ..delivery import SendReceipt
from ..observe._observer import observed
from ._fanout import FanOut
from ._sender import Kind, Sender

__all__ = ["Targets"]


class Targets:
    def __init__(self, sender: Sender) -> None:
        self.sender = sender
        self.fanout = FanOut(sender)

    async def send(
        self,
        kind: Kind,
        target: str | Sequence[str],
        payload: Any,
        request_id: str,
        metadata: Any,
        lend: bool,
    ) -> SendReceipt | list[SendReceipt]:
        def call(traceparent: str) -> Awaitable[SendReceipt | list[SendReceipt]]:
            if isinstance(target, str):
                return self.sender.send(
                    target, payload, request_id, kind, metadata, lend, traceparent
                )
            return self.fanout.send(target, payload, request_id, kind, metadata, lend, traceparent)

        core = self.sender.core
        if core.observer is None:
            return await call("")
        return await observed(core.observer, core.name, _names(target), request_id, kind, call)

    async def end_stream(
        self, target: str | Sequence[str], request_id: str, error: str | None, metadata: Any
    ) -> None:
        def call(traceparent: str) -> Awaitable[None]:
            if isinstance(target, str):
                return self.sender.end_stream(target, request_id, error, metadata, traceparent)
            return self.fanout.end_stream(target, request_id, error, metadata, traceparent)

        core = self.sender.core
        if core.observer is None:
            return await call("")
        await observed(core.observer, core.name, _names(target), request_id, "stream_end", call)


def _names(target: str | Sequence[str]) -> tuple[str, ...]:
    return (target,) if isinstance(target, str) else tuple(target)
