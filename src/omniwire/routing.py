"""Routing policies: which backend carries each edge, and why.

A policy is a pure, deterministic function of its inputs::

    policy.select(edge, payload, candidates) -> Route

``candidates`` are the transports both ends of the edge run (plus ``inline``,
which every endpoint speaks). A policy reads their declared
:class:`~omniwire.backends.base.Capabilities`, never their names, so a
third-party backend becomes routable by declaring what it can do. The
:class:`Route` names the winner, says why, and lists why every other candidate
lost. Policies are swapped by object (``Endpoint(policy=...)``) or by name
through the ``omniwire.policies`` entry-point group.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal, Protocol, runtime_checkable

from .capabilities import Capabilities, Locality
from .errors import NoRouteError
from .wire import INLINE_MAX_TENSOR_BYTES, U64_MAX

__all__ = [
    "INLINE",
    "INLINE_ANY",
    "Candidate",
    "DefaultPolicy",
    "Edge",
    "PayloadInfo",
    "PreferenceOrderPolicy",
    "Route",
    "RoutingPolicy",
    "StaticTablePolicy",
    "StrictDefaultPolicy",
    "check_fit",
    "size_class",
]

Kind = Literal["payload", "stream_chunk"]


@dataclass(frozen=True)
class Edge:
    """One direction between two stages, as the sender sees it after the Hellos."""

    src: str
    dst: str
    locality: Locality
    #: Device kinds each end holds tensors on ("cpu", "cuda").
    src_devices: frozenset[str] = frozenset({"cpu"})
    dst_devices: frozenset[str] = frozenset({"cpu"})
    #: Both ends are GPUs of one host that can access each other's memory.
    gpu_peer_access: bool = False


@dataclass(frozen=True)
class PayloadInfo:
    """What routing may know about a payload: no values, just its shape."""

    kind: Kind
    #: Bytes of tensor data (the packed length).
    nbytes: int
    #: Device kinds of its tensors; empty when it has none.
    devices: frozenset[str] = frozenset()
    tensors: int = 0


@dataclass(frozen=True)
class Candidate:
    """A transport both ends run, with its declared capabilities."""

    name: str
    capabilities: Capabilities
    summary: str = ""


@dataclass(frozen=True)
class Route:
    """A routing decision: the backend, why, and why each other candidate lost."""

    backend: str
    reason: str
    rejected: tuple[tuple[str, str], ...] = ()
    policy: str = ""
    #: True when the winner does not carry the payload's devices natively
    #: (e.g. CUDA tensors staged through host memory).
    fallback: bool = False
    #: ``(lo, hi)``: the policy gives this same route — reason included — to every
    #: payload of this edge, kind, devices and tensor count whose ``nbytes`` lies in
    #: ``[lo, hi]``, so it is reused for them without asking again. ``None`` (the
    #: default): it holds for the payload asked about only.
    sizes: tuple[int, int] | None = None

    def explain(self) -> str:
        lines = [f"{self.backend}: {self.reason}"]
        lines += [f"  not {name}: {why}" for name, why in self.rejected]
        return "\n".join(lines)


class RouteCache:
    """The routes a policy gave on one edge, reused while the edge lasts (policies are
    pure functions of their inputs): by payload shape, and by size class where the
    route has :attr:`Route.sizes` — chunks of varying sizes then ask the policy once
    per class, not once per size. Bounded: full, it starts over."""

    __slots__ = ("_classes", "_exact", "limit")

    def __init__(self, limit: int = 256) -> None:
        self.limit = limit
        self._exact: dict[PayloadInfo, Route] = {}
        #: (kind, devices, tensors) -> [(lo, hi, route)]
        self._classes: dict[tuple[str, frozenset[str], int], list[tuple[int, int, Route]]] = {}

    def get(self, info: PayloadInfo) -> Route | None:
        route = self._exact.get(info)
        if route is None:
            for lo, hi, r in self._classes.get((info.kind, info.devices, info.tensors), ()):
                if lo <= info.nbytes <= hi:
                    return r
        return route

    def put(self, info: PayloadInfo, route: Route) -> None:
        if len(self._exact) + len(self._classes) >= self.limit:
            self._exact.clear()
            self._classes.clear()
        sizes = route.sizes
        if isinstance(sizes, tuple) and len(sizes) == 2 and sizes[0] <= info.nbytes <= sizes[1]:
            key = (info.kind, info.devices, info.tensors)
            self._classes.setdefault(key, []).append((sizes[0], sizes[1], route))
        else:  # no class, or one that does not hold its own payload: this shape only
            self._exact[info] = route


@runtime_checkable
class RoutingPolicy(Protocol):
    """The protocol every policy implements. ``select`` must be pure and deterministic.

    Raises:
        NoRouteError: no candidate may carry this edge (listing each rejection).
    """

    name: str

    def select(
        self, edge: Edge, payload: PayloadInfo, candidates: Sequence[Candidate]
    ) -> Route: ...


#: Stream chunks of at most 16 KiB of CPU tensor data ride inside the control message.
INLINE = Candidate(
    "inline",
    Capabilities(
        devices=frozenset({"cpu"}),
        localities=frozenset(Locality),
        streaming=True,
        payloads=False,
        host_staging=False,
        max_nbytes=INLINE_MAX_TENSOR_BYTES,
        preference=90,
    ),
    summary="carried inside the control message: no buffer, no ACK",
)

#: From wire 1.1 small payloads ride inline too (the candidate offered to 1.1 peers).
INLINE_ANY = Candidate(
    INLINE.name,
    replace(INLINE.capabilities, payloads=True),
    summary=INLINE.summary,
)

_WHERE = {
    Locality.SAME_PROCESS: "same process",
    Locality.SAME_HOST: "same host",
    Locality.CROSS_HOST: "another host",
}


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def check_fit(c: Candidate, edge: Edge, payload: PayloadInfo) -> str | None:
    """Why ``c`` cannot carry ``payload`` on ``edge``, or None if it can."""
    caps = c.capabilities
    if caps.opt_in:
        return f"opt-in only: {caps.opt_in}"
    if edge.locality not in caps.localities:
        served = ", ".join(_WHERE[loc] for loc in Locality if loc in caps.localities)
        return f"reaches {served or 'nothing'}, but {edge.dst!r} is on {_WHERE[edge.locality]}"
    if payload.kind == "stream_chunk" and not caps.streaming:
        return "does not carry stream chunks"
    if payload.kind == "payload" and not caps.payloads:
        return "carries stream chunks only"
    if caps.max_nbytes is not None and payload.nbytes > caps.max_nbytes:
        return f"carries at most {_size(caps.max_nbytes)}"
    foreign = payload.devices - caps.devices
    if foreign and not caps.host_staging:
        return f"carries {'/'.join(sorted(caps.devices))} tensors only, not {'/'.join(sorted(foreign))}"
    if caps.needs_gpu_peer_access:
        if "cuda" not in payload.devices:
            return "carries CUDA tensors between GPUs; this payload has none"
        if "cuda" not in edge.dst_devices:
            return f"{edge.dst!r} is not a GPU stage"
        if not edge.gpu_peer_access:
            return f"the GPUs of {edge.src!r} and {edge.dst!r} cannot access each other"
    return None


def size_class(nbytes: int, candidates: Sequence[Candidate]) -> tuple[int, int]:
    """The sizes ``[lo, hi]`` around ``nbytes`` that every candidate's size limit
    treats alike: :func:`check_fit` says the same of each candidate for all of them."""
    lo, hi = 0, U64_MAX
    for c in candidates:
        limit = c.capabilities.max_nbytes
        if limit is None:
            continue
        if limit < nbytes:
            lo = max(lo, limit + 1)
        else:
            hi = min(hi, limit)
    return lo, hi


def _describe(edge: Edge, payload: PayloadInfo, sizes: tuple[int, int]) -> str:
    what = "stream chunk" if payload.kind == "stream_chunk" else "payload"
    devices = "/".join(sorted(payload.devices)) or "no"
    lo, hi = sizes
    if hi == U64_MAX:
        size = f"more than {_size(lo - 1)}" if lo else "any size"
    else:
        size = f"at most {_size(hi)}" if not lo else f"{_size(lo)} to {_size(hi)}"
    return f"{_WHERE[edge.locality]}, {what} of {size} with {devices} tensors"


class DefaultPolicy:
    """Among the candidates that fit, the highest declared preference wins.

    With the built-ins this gives: same process → local; a small CPU payload or
    stream chunk (≤ 16 KiB of tensor data) → inline (payloads only to wire-1.1 peers); CUDA tensors between GPUs of one host with peer access → cuda_ipc;
    same host → shm; another host → mooncake, else nixl. Opt-in backends (nccl)
    are only used when an edge is configured for them. The policy is total: every
    legal edge gets a route. A backend that does not carry the payload's devices
    natively is used only when nothing else fits (a *fallback*, recorded in the
    route); ``strict=True`` raises :class:`NoRouteError` instead.
    """

    def __init__(self, *, strict: bool = False) -> None:
        self.strict = strict
        self.name = "strict" if strict else "default"

    def select(self, edge: Edge, payload: PayloadInfo, candidates: Sequence[Candidate]) -> Route:
        sizes = size_class(payload.nbytes, candidates)
        rejected: list[tuple[str, str]] = []
        fits: list[Candidate] = []
        for c in candidates:
            why = check_fit(c, edge, payload)
            if why is None:
                fits.append(c)
            else:
                rejected.append((c.name, why))
        native = [c for c in fits if payload.devices <= c.capabilities.devices]
        staged = [c for c in fits if c not in native]
        if self.strict:
            rejected += [(c.name, "would stage tensors through host memory") for c in staged]
        pool = native or ([] if self.strict else staged)
        if not pool:
            raise NoRouteError(
                f"no backend can carry {_describe(edge, payload, sizes)} from {edge.src!r} "
                f"to {edge.dst!r} (policy {self.name})",
                tuple(rejected),
            )
        best = max(pool, key=lambda c: (c.capabilities.preference, c.name))
        for c in fits:
            if c is best or (self.strict and c in staged):
                continue
            if c in staged and best in native:
                rejected.append((c.name, "would stage tensors through host memory"))
            else:
                rejected.append(
                    (
                        c.name,
                        f"fits, but preference {c.capabilities.preference} < "
                        f"{best.capabilities.preference}",
                    )
                )
        fallback = best not in native
        reason = f"{_describe(edge, payload, sizes)}: {best.summary or best.name}"
        if fallback:
            reason += " (fallback: tensors staged through host memory)"
        return Route(best.name, reason, tuple(rejected), self.name, fallback, sizes)


class StrictDefaultPolicy(DefaultPolicy):
    """:class:`DefaultPolicy` that raises instead of falling back."""

    def __init__(self) -> None:
        super().__init__(strict=True)


class PreferenceOrderPolicy:
    """Try backends in a fixed order; the first that fits wins.

    Candidates not in ``order`` are used (by the default policy) only when none
    of the listed ones fits, unless ``strict`` is set.
    """

    def __init__(self, order: Sequence[str], *, strict: bool = False) -> None:
        self.order = tuple(order)
        self.strict = strict
        self.name = "preference(" + ">".join(self.order) + ")"

    def select(self, edge: Edge, payload: PayloadInfo, candidates: Sequence[Candidate]) -> Route:
        sizes = size_class(payload.nbytes, candidates)
        by_name = {c.name: c for c in candidates}
        rejected: list[tuple[str, str]] = []
        for name in self.order:
            c = by_name.get(name)
            if c is None:
                rejected.append((name, "not run by both ends"))
                continue
            why = check_fit(_chosen(c), edge, payload)  # naming an opt-in backend opts in
            if why is not None:
                rejected.append((name, why))
                continue
            rejected += [
                (o.name, f"after {name} in the preference order")
                for o in candidates
                if o.name != name
            ]
            return Route(
                name,
                f"{_describe(edge, payload, sizes)}: first fit in preference order",
                tuple(rejected),
                self.name,
                sizes=sizes,
            )
        if self.strict:
            raise NoRouteError(
                f"no backend in {list(self.order)} can carry {_describe(edge, payload, sizes)} "
                f"to {edge.dst!r}",
                tuple(rejected),
            )
        route = DefaultPolicy().select(edge, payload, candidates)
        return Route(
            route.backend,
            route.reason + " (none of the preferred fit)",
            tuple(rejected) + route.rejected,
            self.name,
            route.fallback,
            sizes,
        )


class StaticTablePolicy:
    """Fixed backends for chosen edges; everything else goes to ``fallback``.

    Keys, most specific first: ``"src->dst:kind"``, ``"src->dst"``, ``"dst:kind"``,
    ``"dst"`` (``kind`` is ``payload`` or ``stream_chunk``). A configured backend
    that cannot carry the edge is a :class:`NoRouteError`, never a silent detour.
    """

    def __init__(self, table: Mapping[str, str], fallback: RoutingPolicy | None = None) -> None:
        self.table = dict(table)
        self.fallback = fallback if fallback is not None else DefaultPolicy()
        self.name = f"static+{self.fallback.name}"

    def unmatched(self, name: str, peers: Collection[str]) -> list[str]:
        """Why each key of the table can match no edge of endpoint ``name`` whose
        peers are ``peers`` (a typo, most likely); empty if every key can match."""
        problems = []
        for key in self.table:
            src, sep, dst = key.partition("->")
            if not sep:
                src, dst = name, key
            for kind in ("payload", "stream_chunk"):
                dst = dst.removesuffix(f":{kind}")
            if src != name:
                problems.append(f"routes key {key!r}: {src!r} is not this endpoint ({name!r})")
            elif dst not in peers:
                problems.append(
                    f"routes key {key!r} names no configured peer ({dst!r} is not in peers=: "
                    f"{', '.join(sorted(peers))}); it applies only if a peer of that name connects"
                )
        return problems

    def lookup(self, edge: Edge, kind: str) -> tuple[str, str] | None:
        for key in (
            f"{edge.src}->{edge.dst}:{kind}",
            f"{edge.src}->{edge.dst}",
            f"{edge.dst}:{kind}",
            edge.dst,
        ):
            if key in self.table:
                return key, self.table[key]
        return None

    def select(self, edge: Edge, payload: PayloadInfo, candidates: Sequence[Candidate]) -> Route:
        hit = self.lookup(edge, payload.kind)
        if hit is None:
            return self.fallback.select(edge, payload, candidates)
        key, name = hit
        c = next((c for c in candidates if c.name == name), None)
        if c is None:
            raise NoRouteError(
                f"route {key!r} → {name!r} is configured, but {name!r} is not run by both "
                f"{edge.src!r} and {edge.dst!r} (they share: {', '.join(x.name for x in candidates)})"
            )
        why = check_fit(_chosen(c), edge, payload)
        if why is not None:
            raise NoRouteError(f"route {key!r} → {name!r} is configured, but {name} {why}")
        rejected = tuple(
            (o.name, f"edge {key!r} is configured for {name}") for o in candidates if o.name != name
        )
        sizes = size_class(payload.nbytes, candidates)
        reason = f"{_describe(edge, payload, sizes)}: configured for edge {key!r}"
        return Route(name, reason, rejected, self.name, sizes=sizes)


def _chosen(c: Candidate) -> Candidate:
    """``c`` as explicitly chosen by configuration: its opt-in is satisfied."""
    return Candidate(c.name, replace(c.capabilities, opt_in=None), c.summary)
