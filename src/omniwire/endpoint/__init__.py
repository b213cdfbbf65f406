"""``omniwire.endpoint``: one stage of a pipeline, as a facade over small parts.

============  ===================================================================
module        what it does
============  ===================================================================
_facade       :class:`Endpoint`: configuration, lifecycle, the public API
_config       checks every option at construction
_peers        the peer table: Hello, refusals, liveness, loss, Goodbye
_sender       send/stream/end_stream: encode → route → credit → pack → announce
_fanout       one payload to several targets: encoded once, packed once (shared refs)
_receiver     the take path (import → fetch → deliver → ACK)
_deliveries   the delivery queue: scoped/unscoped consumers, holds, receive budget
_receiving    the receiving half of the public API (receive, deliveries, requests)
_lifecycle    start, cancel-safe close, housekeeping
_dispatch     frames in: decode, check, hand each message to its part
_outbox       frames out: the one way a frame leaves, in order per peer
_aborts       aborted requests, send guards, forwarding down the pipeline
_records      one record per peer and per object in flight, per side
_supervisor   background tasks, outside the caller's cancel scopes
_stats        route statistics, counters, bounded logging
============  ===================================================================
"""

from ._deliveries import DeliveryStream
from ._facade import Endpoint
from ._stats import RouteStats

__all__ = ["DeliveryStream", "Endpoint", "RouteStats"]
