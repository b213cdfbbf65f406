"""Which backend each edge uses, remembered, and what went that way.

The policy is asked once per peer session and payload shape (the peer's
:class:`~omniwire.routing.RouteCache`); a stream of chunks of one shape is matched
to its route by its pack plan without building the payload's description again.
Each route taken is logged once per peer, kind and backend (``omniwire.route``:
INFO the first time, DEBUG after), and counted in :class:`~._stats.RouteStats`.
"""

from __future__ import annotations

import logging
import sys

import torch

from .. import packing
from ..routing import PayloadInfo, Route, RouteCache
from ._core import Core
from ._inline import Kind, payload_info
from ._records import Peer
from ._stats import RouteStats

__all__ = ["RouteBook"]

route_log = logging.getLogger("omniwire.route")

_Key = tuple[str, str, str]  # (peer, kind, backend)


class RouteBook:
    """The routes of one endpoint's sends and their statistics.

    Args:
        core: the endpoint's shared state (its name, and the policy in its config).
        trace: print every route chosen to stderr (``OMNIWIRE_TRACE=1``).
    """

    def __init__(self, core: Core, trace: bool = False) -> None:
        self.core = core
        self.trace = trace
        #: what went each way, by (peer, kind, backend)
        self.stats: dict[_Key, RouteStats] = {}
        self._seen: set[_Key] = set()  # logged at INFO already
        #: the keys of ``stats`` and ``_seen``, by peer name (for :meth:`forget`)
        self._keys_of: dict[str, set[_Key]] = {}
        #: route_of's memo: (id(plan), kind, peer) -> (plan, the peer's RouteCache, route)
        self._by_plan: dict[tuple[int, str, str], tuple[packing.PackPlan, RouteCache, Route]] = {}

    def route_of(
        self, peer: Peer, kind: Kind, tensors: list[torch.Tensor], layout: packing.PackPlan
    ) -> Route:
        """:meth:`select` for a payload packed by ``layout``, remembered by the plan for
        the peer's session (its RouteCache): a stream of chunks of one shape asks once.
        (Plans are cached by shape, so the same shape is the same plan object.)"""
        key = (id(layout), kind, peer.name)
        hit = self._by_plan.get(key)
        if hit is not None and hit[0] is layout and hit[1] is peer.routes and not self.trace:
            return hit[2]
        route = self.select(peer, payload_info(kind, tensors, layout))
        if len(self._by_plan) >= packing.PLANS_MAX:  # a plan each: they thrash together
            self._by_plan.clear()
        self._by_plan[key] = (layout, peer.routes, route)  # holds the plan: its id stays its
        return route

    def select(self, peer: Peer, info: PayloadInfo) -> Route:
        """The policy's route for this edge and payload (cached per peer session)."""
        assert peer.edge is not None
        route = peer.routes.get(info)
        if route is None:
            route = self.core.config.policy.select(peer.edge, info, peer.candidates)
            peer.routes.put(info, route)
            key = (peer.name, info.kind, route.backend)
            level = logging.DEBUG
            if key not in self._seen:
                self._seen.add(key)
                self._keys_of.setdefault(peer.name, set()).add(key)
                level = logging.INFO
            if route_log.isEnabledFor(level):
                route_log.log(
                    level, "%s→%s %s: %s", self.core.name, peer.name, info.kind, route.explain()
                )
        if self.trace:
            print(
                f"[omniwire] route {self.core.name}→{peer.name} {info.kind}: {route.explain()}",
                file=sys.stderr,
            )
        return route

    def stats_of(self, peer: str, kind: str, route: Route) -> RouteStats:
        """The statistics of what goes to ``peer`` as ``kind`` by ``route``'s backend."""
        key = (peer, kind, route.backend)
        stats = self.stats.get(key)
        if stats is None:
            stats = self.stats[key] = RouteStats(peer, kind, route.backend, route.reason)
            self._keys_of.setdefault(peer, set()).add(key)
        stats.route = route
        return stats

    def forget(self, peer: str) -> None:
        """Forget the routes and statistics of the gone peer ``peer``."""
        for key in self._keys_of.pop(peer, ()):
            self.stats.pop(key, None)
            self._seen.discard(key)
