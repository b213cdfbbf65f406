"""What cuda_ipc keeps per peer (its GPU, its release event, the shares made for it,
its buffers and events mapped here) and the table of peers, which gives back what a
peer held when it goes."""

from __future__ import annotations

import collections
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from ...errors import BackendError
from ..base import PeerInfo
from ..support import Releaser
from ._blobs import Share
from ._gpu import CudaApi, Event, release_shares

if TYPE_CHECKING:
    from ._handles import Mapped

__all__ = ["PeerState", "Peers"]

#: freed shares remembered per peer, to release their counters if the peer dies.
_RECENT_SHARES = 4096


@dataclass(eq=False)
class PeerState:
    key: tuple[str, int]
    pid: int
    name: str
    reachable: bool
    #: the peer's receiving GPU, as a local index (None: not visible here)
    device: int | None
    release_handle: bytes
    #: sender side: the peer's release event, opened here (None: not yet; False: cannot)
    release: Event | Literal[False] | None = None
    pool_share: Share | None = None
    recent_shares: collections.deque[Share] = field(
        default_factory=lambda: collections.deque(maxlen=_RECENT_SHARES)
    )
    #: receiver side: the peer's buffers mapped here, its events opened here
    pools: dict[int, Mapped] = field(default_factory=dict)
    events: dict[int, tuple[bytes, Event]] = field(default_factory=dict)


class Peers:
    """The peers that announced cuda_ipc in their Hello, by key."""

    def __init__(self, api: CudaApi, reaper: Releaser) -> None:
        self._api = api
        self._reaper = reaper
        self._by_key: dict[tuple[str, int], PeerState] = {}

    def __iter__(self) -> Iterator[PeerState]:
        """A snapshot: peers may be added or forgotten meanwhile."""
        return iter(list(self._by_key.values()))

    def add(self, st: PeerState) -> None:
        self._by_key[st.key] = st

    def pop(self, key: tuple[str, int]) -> PeerState | None:
        return self._by_key.pop(key, None)

    def clear(self) -> None:
        self._by_key.clear()

    def state(self, peer: PeerInfo) -> PeerState:
        """The peer's state.

        Raises:
            BackendError: the peer did not announce cuda_ipc, or is not on this host.
        """
        st = self._by_key.get(peer.key)
        if st is None:
            raise BackendError(f"{peer.name!r} did not announce cuda_ipc in its Hello")
        if not st.reachable:
            raise BackendError(
                f"cuda_ipc reaches processes on this host only; {peer.name!r} is "
                f"{peer.locality.value.replace('_', ' ')}"
            )
        return st

    def released(self, holder: tuple[str, int]) -> bool:
        """Whether the receiver ``holder`` is done with every slot it was given."""
        st = self._by_key.get(holder)
        release = st.release if st is not None else None
        if release is None or release is False:
            return True
        try:
            return bool(release.query())
        except Exception:
            return True

    def forget(self, st: PeerState, dead: bool) -> None:
        """Drop what is mapped from the peer and, if its process ``dead``, give back
        torch's counters of what was shared with it (in the reaper)."""
        mapped = list(st.pools.values())
        st.pools.clear()
        st.events.clear()
        # The peer cannot give back torch's counters of what we shared with it any more:
        # do it for it (an extra release of a dead consumer's share frees nothing early).
        orphaned = list(st.recent_shares) if dead else []
        if dead and st.pool_share is not None:
            orphaned.append(st.pool_share)
        st.recent_shares.clear()
        st.release = None
        api = self._api

        def clean_up() -> None:
            release_shares(api, orphaned)
            mapped.clear()  # the storages die here, in the reaper

        if mapped or orphaned:
            self._reaper.submit(clean_up)
