"""``omniwire.endpoint``: one stage of a pipeline, as a facade over small parts.

============  ===================================================================
module        what it does
============  ===================================================================
_facade       :class:`Endpoint`: configuration, lifecycle, the public API
_config       OPTIONS, every option declared once; the checked configuration
_peers        the peer table: Hello, refusals, liveness, loss, Goodbye
_handshake    Hello building and checking, refusals, what a peer's Hello offers
_rings        a same-host peer's control ring: offer, attach, start reading
_sender       send/stream/end_stream: encode → route → credit → export → announce
_ledger       what is in flight to each peer and what ends it: ACK, NACK, abort, loss, deadline
_routebook    the route of each edge and payload shape, remembered; what went that way
_inline       payloads inside their DataReady: the message, its charge, its receipt
_exporting    an object's bytes for its backend: lent in place, or packed (in pieces)
_buffers      transport buffers (``Endpoint.empty``): tensors born in backend memory
_targets      one target or several (a fan-out), inside the observer's span
_fanout       one payload to several targets: encoded once, packed once (shared refs)
_receiver     the take path (read → deliver → ACK) and the one release path
_holds        holds on received memory: zero-copy deliveries lent, forwards of them
_reading      reading an announced object: import, fetch as announced, rebuild
_inbox        a peer's DataReadys waiting to be taken, oldest first, by request id
_deliveries   the delivery queue: scoped/unscoped consumers, holds, receive budget
_receiving    the receiving half of the public API (receive, deliveries, requests)
_lifecycle    start, cancel-safe close, housekeeping
_dispatch     frames in: decode, check, hand each message to its part
_outbox       frames out: the one way a frame leaves, in order per peer
_aborts       aborted requests, send guards, forwarding down the pipeline
_records      one record per peer and per object in flight, per side
_supervisor   background tasks, outside the caller's cancel scopes
_core         what the parts share: identity, configuration, sockets, counters
_stats        route statistics; COUNTERS, the registry of counter names
============  ===================================================================
"""

from ._deliveries import DeliveryStream
from ._facade import Endpoint
from ._stats import COUNTERS, RouteStats

__all__ = ["COUNTERS", "DeliveryStream", "Endpoint", "RouteStats"]
