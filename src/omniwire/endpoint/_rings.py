"""The same-host control ring of a peer (spec §3.6): offer a ring for its frames in
our Hellos, attach to the ring it offers, and start reading ours once it says it
attached. ZeroMQ carries everything until then, and stays for other hosts.
"""

from __future__ import annotations

from collections.abc import Callable

from .. import wire
from ..ring import RingError, RingReader, RingWriter
from ._core import Core, State
from ._handshake import hello_of
from ._records import Peer, PeerStatus

__all__ = ["attach_ring", "offer_ring"]


def _ring_ok(core: Core, hello: wire.HelloMessage) -> bool:
    return (
        core.config.control_ring
        and hello.host_id == core.host_id
        and "ring" in hello.features
        and core.state is State.OPEN
    )


def offer_ring(core: Core, peer: Peer, hello: wire.HelloMessage) -> bool:
    """Create a ring for the peer's frames (offered in our Hellos); True if new."""
    if peer.ring_reader is not None or not _ring_ok(core, hello):
        return False
    try:
        peer.ring_reader = RingReader.create()
    except (RingError, OSError) as exc:
        core.noisy.warning("ring", "%s: no ring for %s: %s", core.name, peer.name, exc)
        return False
    return True


def attach_ring(
    core: Core, peer: Peer, hello: wire.HelloMessage, on_ring: Callable[[Peer, RingReader], None]
) -> None:
    """Attach to the ring the peer offers (its files are checked off the loop); the
    next Hello (on ZeroMQ) says so, and every frame after it goes through the ring.
    Start reading ours once the peer said it attached (everything it sent by ZeroMQ
    before has been read then)."""
    if (
        hello.ring
        and hello.ring not in (peer.ring_attached, peer.ring_attaching)
        and _ring_ok(core, hello)
    ):
        peer.ring_attaching = hello.ring
        core.supervisor.spawn(_attach, core, peer, hello, peer.generation)
    reader = peer.ring_reader
    attached = reader is not None and hello.ring_attached == reader.name
    if attached and reader is not None and not peer.ring_reading:
        if reader.writer_pid != hello.pid:  # someone else took it: stay on ZeroMQ
            core.noisy.warning(
                "ring",
                "%s: the ring offered to %s was attached by pid %s, not %s; closed",
                core.name,
                peer.name,
                reader.writer_pid,
                hello.pid,
            )
            reader.close()
            peer.ring_reader = None
            return
        peer.ring_reading = True
        on_ring(peer, reader)


async def _attach(core: Core, peer: Peer, hello: wire.HelloMessage, generation: int) -> None:
    try:
        writer = await RingWriter.open(hello.ring, owner_pid=hello.pid)
    except (RingError, OSError) as exc:
        core.noisy.warning("ring", "%s: cannot use %s's ring: %s", core.name, peer.name, exc)
        return
    finally:
        if peer.ring_attaching == hello.ring:
            peer.ring_attaching = ""
    if (
        peer.generation != generation
        or peer.status in (PeerStatus.LOST, PeerStatus.CLOSED)
        or not _ring_ok(core, hello)
    ):
        writer.close()  # the session it was offered in is over
        return
    if peer.ring_writer is not None:  # a new ring in the same session
        peer.ring_writer.close()
        peer.ring_writer = None  # the fence below still goes by ZeroMQ
    peer.ring_attached = hello.ring
    core.outbox.post(peer, hello_of(core, peer, reply=True, ring_attached=hello.ring))
    core.outbox.switch_to_ring(peer, writer)
