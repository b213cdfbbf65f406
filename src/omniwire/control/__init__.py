"""The control plane: ZeroMQ sockets that move frames, and nothing else.

Each endpoint binds one PULL socket (its ``address``) that every peer PUSHes
frames into, and one PUB socket for aborts that every peer's SUB listens to. It
connects one PUSH per peer and its one SUB to every peer's PUB. ``ipc://`` on one
host, ``tcp://`` across hosts. The control plane does not decode frames and knows
nothing of backends; it reports connection events so the endpoint can tell a dead
peer, and how long a peer has taken no frame so it can tell a hung one.

Every address is checked by :func:`parse_address` before ZeroMQ sees it, and no
``ZMQError`` leaves a public method: a bad address is an :class:`AddressError`, a
served one an :class:`AddressInUseError`, a closed plane an
:class:`EndpointClosedError`.

Authentication (optional): with a shared key every socket runs ZMQ CURVE
(encrypted, authenticated); the bound sockets accept only clients that present
the key pair derived from the same key, so a process without the key can
deliver nothing — no DataReady, no ACK, no abort.

========  ======================================================================
module    what it does
========  ======================================================================
_plane    :class:`ControlPlane`: start, close, and the public methods
_sockets  the context and authenticator, socket options, open sockets, bound files
_links    one PUSH socket per peer: connect, send with bounded waits, its monitor
_aborts   the PUB socket aborts are published on, the SUB to every peer's PUB
_receive  the PULL socket read in batches (its FD watched directly), pending reads
_once     send_once: one frame through a transient socket, rate-limited
_curve    :class:`CurveKey`, the ZAP credentials provider
========  ======================================================================
"""

from ._curve import CurveKey
from ._links import PeerEvent
from ._plane import ControlPlane

__all__ = ["ControlPlane", "CurveKey", "PeerEvent"]
