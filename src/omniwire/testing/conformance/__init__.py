"""The backend conformance suite. Any backend — omniwire's or a third party's — runs it
by subclassing :class:`BackendConformance` in a test module::

    from omniwire.testing import BackendConformance

    class TestMyBackend(BackendConformance):
        backend = "my_backend"
        backend_options = {"my_backend": {"port": 0}}

It checks, through real endpoints:

- put/get round trips of Hypothesis payloads (every dtype and shape), bit-exact,
  between this process and a peer process (``two_process = True``, the default)
  or an endpoint in this process (``two_process = False``, for ``local``);
- stream chunks arrive in order; large objects (progressive announce) arrive whole;
- ACK and release: after round trips nothing is left in flight, and the backends
  of *both* endpoints hold no handle (the typed :class:`BackendStats` contract:
  ``stats().idle``, filled by the base class for every backend);
- credits: a slow consumer makes the sender wait; nothing is dropped;
- abort: an aborted request's sends end, and its handles are released on both
  sides (the peer is asked for its backends' stats);
- declared capabilities against what the backend really does, on two bare
  instances in this process: the byte layout round trip (in ranges when it
  declares ``progressive``), ``zero_copy`` (the bytes viewable without a
  destination), ``mapped`` (viewable right after import), ``two_sided`` (an
  import closed unfetched keeps later objects paired) or its absence (an export
  never imported is released cleanly), ``devices`` (export buffers on a declared
  device), ``max_nbytes``, lent tensors (``export_tensors(..., lent=True)`` yields
  the packed image), and idempotent, counted handles;
- close semantics and error mapping: a closed backend refuses export and import
  with ``BackendClosedError``; a malformed or foreign reference is a
  ``BackendError``, never a crash.

A backend that cannot run here is skipped with its reason — or fails, when
``OMNIWIRE_REQUIRE_ENGINES=1`` (CI sets it), unless the backend needs a GPU
(``needs_gpu = True`` on its class) and none is present.

Needs the ``test`` extra (pytest, hypothesis).
"""

from __future__ import annotations

from ._bare import BareChecks
from ._endtoend import EndToEndChecks
from ._support import PeerProcess, ipc_address, require_backend, to_device

__all__ = ["BackendConformance", "PeerProcess", "ipc_address", "require_backend", "to_device"]


class BackendConformance(EndToEndChecks, BareChecks):
    """Subclass and set ``backend``. See the module docstring for what is checked."""
