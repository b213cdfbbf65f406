"""nccl's worker threads: the loops that wait on the engine for a link — reapers
(the tagged and ordered channels' sends), the tagged channel's receives, and the
ordered channel's FIFO sender and receiver. Each drains one of the link's queues
until it gets ``None``; any engine error fails the link."""

from __future__ import annotations

import contextlib
import logging
import queue
import time
from typing import TYPE_CHECKING, Any

import torch

from ... import hops
from ...errors import BackendError
from ._engine import Work, engine_error, header
from ._objects import CTL_TAG, Header, Inbound, Outbound

if TYPE_CHECKING:
    from ._link import Link

__all__ = ["ordered_recv_loop", "ordered_send_loop", "reap_loop", "recv_loop"]

log = logging.getLogger("omniwire.nccl")

_cuda: Any = torch.cuda  # Stream/Event constructors are untyped


def reap_loop(link: Link, q: queue.SimpleQueue[Any]) -> None:
    while True:
        works = q.get()
        with link.lock:
            link.idle_reapers -= 1
        if works is None:
            return
        for work, _tensor in works:
            if link.error is not None:
                link.graveyard.append(works)
                break
            try:
                work.wait()
            except Exception as exc:
                link.fail(engine_error(f"send to {link.pair.name!r} failed", exc))
                break
        else:
            hops.mark("engine: send ended (reaper thread)")
            link.backend.counters["sends_completed"] += 1
        with link.lock:
            link.idle_reapers += 1


def recv_loop(link: Link, q: queue.SimpleQueue[Any]) -> None:
    while True:
        h = q.get()
        if h is None:
            return
        if link.error is not None:
            link.graveyard.append(h.works)
            continue
        try:
            for work in h.works:
                work.wait()
        except Exception as exc:
            link.fail(engine_error(f"receive from {link.pair.name!r} failed", exc))
            continue
        hops.mark("engine: receive ended (worker thread)")
        link.backend.counters["bytes_received"] += h.nbytes
        link.complete(h, None)


def ordered_send_loop(link: Link, q: queue.SimpleQueue[Any]) -> None:
    link.ready.wait()
    stream = None
    while True:
        o: Outbound | None = q.get()
        if o is None:
            return
        if link.error is not None:
            continue
        try:
            (tensor,) = o.tensors  # the ordered channel carries packed objects only
            head = header(o.tag, o.nbytes, o.device)
            hwork = link.gloo().send([head], link.peer, CTL_TAG)
            works: list[tuple[Work, torch.Tensor]]
            if o.device == "cuda":
                if stream is None:
                    stream = _cuda.Stream(tensor.device)
                stream.wait_event(o.event)
                assert link.nccl_out is not None
                with torch.cuda.stream(stream):
                    work = link.nccl_out.send([tensor], link.peer, 0)
                    work.wait()
                stream.synchronize()  # blocks this thread only
                # The peer read the header before it posted its NCCL receive.
                works = [(hwork, head)]
            else:
                work = link.gloo().send([tensor], link.peer, o.tag)
                works = [(hwork, head), (work, tensor)]
        except Exception as exc:
            link.fail(engine_error(f"send to {link.pair.name!r} failed", exc))
            continue
        with link.lock:
            o.works.extend(works)
            o.posted = True
            if o.freed or o.device == "cuda":
                link.reap(o)


def _await_claim(link: Link, tag: int) -> Inbound | None:
    """The object ``tag`` once claimed; None if it was never claimed in time."""
    deadline = time.monotonic() + link.backend.timeout
    with link.cond:
        while link.error is None:
            h = link.regs.get(tag)
            if h is not None and (h.consume or h.target is not None):
                del link.regs[tag]
                return h
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                link.expire(tag)
                if h is not None:  # opened but never fetched: fail it
                    del link.regs[tag]
                    h.consume = True
                    h.error = BackendError(f"object (tag {tag}) was not fetched in time")
                    return h
                return None
            link.cond.wait(remaining)
    return None


def ordered_recv_loop(link: Link, q: queue.SimpleQueue[Any]) -> None:
    link.ready.wait()
    stream = None
    while True:
        hd: Header | None = q.get()
        if hd is None:
            return
        if link.error is not None:
            link.graveyard.append(hd.work)
            continue
        try:
            hd.work.wait()
        except Exception as exc:
            link.fail(engine_error(f"receive from {link.pair.name!r} failed", exc))
            continue
        tag, nbytes, is_cuda = (int(v) for v in hd.tensor.view(torch.int64))
        device = "cuda" if is_cuda else "cpu"
        h = _await_claim(link, tag)
        if link.failed():
            continue
        if h is None:  # announced but never opened nor dropped: its DataReady was lost
            log.warning(
                "nccl: object (tag %d, %d bytes) from %s was never claimed; discarded",
                tag,
                nbytes,
                link.pair.name,
            )
            # That header took a receive posted for another object: post another.
            with link.lock, contextlib.suppress(Exception):
                link.post_header()
        error = h.error if h is not None else None
        if h is not None and (h.nbytes != nbytes or h.device != device):
            error = BackendError(
                f"ordered object from {link.pair.name!r}: reference says {h.nbytes} bytes "
                f"on {h.device}, the sender sent {nbytes} bytes on {device}"
            )
        target = h.target if h is not None and error is None and not h.consume else None
        try:
            if device == "cuda":
                if stream is None:
                    stream = _cuda.Stream(link.backend.cuda_device)
                _recv_cuda(link, nbytes, tag, target, stream)
            else:
                buf = target if target is not None else link.backend.scratch(nbytes)
                link.gloo().recv([buf], link.peer, tag).wait()
        except Exception as exc:
            link.fail(engine_error(f"receive from {link.pair.name!r} failed", exc))
            continue
        link.backend.counters["bytes_received"] += nbytes
        if h is not None:
            link.complete(h, error)
        else:
            link.backend.counters["objects_consumed"] += 1


def _recv_cuda(link: Link, nbytes: int, tag: int, target: torch.Tensor | None, stream: Any) -> None:
    buf: torch.Tensor
    if target is None or target.device.type != "cuda":
        buf = torch.empty(nbytes, dtype=torch.uint8, device=link.backend.cuda_device)
    else:
        buf = target
    staged = buf is not target
    assert link.nccl_in is not None
    with torch.cuda.stream(stream):
        work = link.nccl_in.recv([buf], link.peer, 0)
        work.wait()
        if target is not None and staged:
            target.copy_(buf)
    stream.synchronize()
