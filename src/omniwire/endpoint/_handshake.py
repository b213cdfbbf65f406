"""The Hello: what this endpoint says, whom it accepts, and how it refuses (spec §4.1, §4.9).

A Hello is refused — a RefusalMessage goes back to its address, best effort and
rate-limited, and nothing of the sender is kept — when it uses our own name,
addresses another name, speaks no common major version, carries an address
ZeroMQ cannot use, would overflow the peer table, or claims the name of a peer
whose instance is still alive (a restart is accepted once the old instance is
gone: its process died, its connection broke, or it said Goodbye).
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from .. import hostinfo, wire
from ..addresses import parse_address
from ..backends._peermem import SEALING
from ..backends.base import PeerInfo
from ..capabilities import Locality
from ..errors import (
    AddressError,
    NameClashError,
    PeerNameMismatchError,
    PeerRefusedError,
)
from ._core import Core
from ._records import Peer, PeerStatus

__all__ = ["check_hello", "hello_of", "locality_of", "peer_infos", "refusal_error", "refuse"]


def hello_of(
    core: Core, peer: Peer | None, *, reply: bool, ring_attached: str = ""
) -> wire.HelloMessage:
    """This endpoint's Hello, addressed to ``peer`` by the name we know it by, offering
    the ring we created for its frames (if any)."""
    features = (
        ("pickle", core.config.allow_pickle),
        ("zero_copy", core.config.zero_copy),
        ("ring", core.config.control_ring),
        ("digest", True),  # this endpoint checks DataRef.digest (spec §7.7)
        ("sealed", SEALING),  # it reads sealed segments (spec §9.2, §11.2)
        (wire.RESUME_FEATURE, core.config.resume_window > 0),  # spec §10.7
    )
    return wire.HelloMessage(
        endpoint=core.name,
        wire_min=(wire.WIRE_VERSION[0], 0),
        wire_max=wire.WIRE_VERSION,
        features=tuple(f for f, on in features if on),
        host_id=core.host_id,
        hostname=hostinfo.hostname(),
        pid=os.getpid(),
        process_token=hostinfo.process_token(),
        instance=core.instance,
        address=core.control.address,
        abort_address=core.control.abort_address,
        devices=core.devices,
        backends=tuple(
            wire.BackendInfo(name=n, info=b.hello() if peer is None else b.hello_to(peer.name))
            for n, b in core.backends.items()
        ),
        is_reply=reply,
        to_endpoint=peer.name if peer is not None else "",
        ring=peer.ring_reader.name if peer is not None and peer.ring_reader is not None else "",
        ring_attached=ring_attached,
        window=core.config.receive_window,
        epoch=peer.epoch if peer is not None else 0,
        session=peer.session.token if peer is not None and core.config.resume_window > 0 else 0,
    )


def check_hello(
    core: Core, hello: wire.HelloMessage, known: Peer | None, peers: Iterable[Peer]
) -> tuple[wire.RefusalCode, str] | None:
    """Why ``hello`` must be refused (a code and a detail), or None to accept it.

    ``known`` is the table's entry under the Hello's name, if any.
    """
    if hello.endpoint == core.name:
        if hello.instance == core.instance:
            return None  # our own Hello looped back (an address shared by mistake)
        return "own_name", f"{core.name!r} is this endpoint's own name"
    if hello.to_endpoint and hello.to_endpoint != core.name:
        return "name_mismatch", (
            f"the Hello addresses {hello.to_endpoint!r}, but this endpoint is {core.name!r}"
        )
    if wire.negotiate(hello) is None:
        core.counters["version_refused"] += 1
        return "version", (
            f"this endpoint speaks wire {wire.WIRE_VERSION[0]}.0–"
            f"{wire.WIRE_VERSION[0]}.{wire.WIRE_VERSION[1]}"
        )
    try:
        parse_address(hello.address, what="HelloMessage.address")
        if hello.abort_address:
            parse_address(hello.abort_address, what="HelloMessage.abort_address")
    except AddressError as exc:
        return "bad_hello", str(exc)
    if known is None or known.status in (PeerStatus.LOST, PeerStatus.CLOSED):
        live = sum(p.status not in (PeerStatus.LOST, PeerStatus.CLOSED) for p in peers)
        if known is None and live >= core.config.max_peers:
            return "peer_limit", f"this endpoint serves at most {core.config.max_peers} peers"
        known = None  # gone: a new instance may take the name
    for name, pinfo in peer_infos(core, hello).items():
        why = core.backends[name].accepts(pinfo)
        if why is not None:
            return "bad_hello", f"backend {name}: {why}"
    old = known.hello if known is not None else None
    if old is None or (old.instance, old.process_token) == (hello.instance, hello.process_token):
        return None
    if known is not None and _gone(core, known, hello):
        return None
    return "name_in_use", (
        f"a live endpoint {hello.endpoint!r} (pid {old.pid} on {old.hostname or old.host_id}) "
        f"is connected to {core.name!r} under that name"
    )


def locality_of(core: Core, hello: wire.HelloMessage) -> Locality:
    if hello.host_id != core.host_id:
        return Locality.CROSS_HOST
    if hello.process_token == hostinfo.process_token():
        return Locality.SAME_PROCESS
    return Locality.SAME_HOST


def peer_infos(core: Core, hello: wire.HelloMessage) -> dict[str, PeerInfo]:
    """What each backend both ends run learns of the peer from its Hello."""
    theirs = {b.name: b.info for b in hello.backends}
    locality = locality_of(core, hello)
    kinds = tuple(sorted({d.kind for d in hello.devices} or {"cpu"}))
    address = parse_address(hello.address)
    host = address.host.strip("[]") if address.scheme == "tcp" and address.host else "127.0.0.1"
    return {
        name: PeerInfo(
            name=hello.endpoint,
            instance=hello.instance,
            pid=hello.pid,
            host_id=hello.host_id,
            process_token=hello.process_token,
            locality=locality,
            info=theirs[name],
            devices=kinds,
            host=host,
            features=tuple(hello.features),
        )
        for name in core.backends
        if name in theirs
    }


def _gone(core: Core, peer: Peer, hello: wire.HelloMessage) -> bool:
    """Whether the instance ``peer`` holds now is gone (so ``hello``'s may take the name)."""
    old = peer.hello
    if old is None:
        return True
    if old.host_id == core.host_id and not hostinfo.pid_alive(old.pid):
        return True
    if peer.down_since is not None:
        return True  # its connection broke: the restart replaces it
    # Our link broke and came back (a resuming session lives on, spec §10.7) to the
    # address the new instance says it holds: no two processes bind one address, so
    # the old instance no longer holds it.
    return peer.relinked and peer.address == hello.address


def refuse(core: Core, hello: wire.HelloMessage, code: wire.RefusalCode, detail: str) -> None:
    """Count and log a refused Hello, and tell its sender (best effort)."""
    core.counters["hellos_refused"] += 1
    core.noisy.warning(
        "refuse:" + code,
        "%s refused a Hello from %r (%s): %s",
        core.name,
        hello.endpoint,
        code,
        detail,
    )
    if hello.is_reply:  # a refused reply answers our own Hello: no need to answer it
        return
    try:
        address = str(parse_address(hello.address))
    except AddressError:
        return
    refusal = wire.RefusalMessage(
        from_stage=core.name,
        to_stage=hello.endpoint,
        code=code,
        detail=detail[: wire.MAX_TEXT_BYTES // 4],
        addressed=hello.to_endpoint,
    )
    if core.outbox.refuse(address, refusal):
        core.counters["refusals_sent"] += 1


def refusal_error(core: Core, peer: Peer, msg: wire.RefusalMessage) -> PeerRefusedError:
    """The error the waiters for ``peer`` get for a Refusal."""
    cls: type[PeerRefusedError] = PeerRefusedError
    if msg.code in ("name_in_use", "own_name"):
        cls = NameClashError
    elif msg.code == "name_mismatch":
        cls = PeerNameMismatchError
    if msg.code == "name_mismatch":
        where = f" at {peer.configured}" if peer.configured else ""
        what = f"peers={{{peer.name!r}: ...}}: the endpoint{where} calls itself {msg.from_stage!r}"
    else:
        what = f"{msg.from_stage!r} refused {core.name!r}"
    return cls(f"{what} ({msg.code}): {msg.detail}", peer=peer.name, code=msg.code)
