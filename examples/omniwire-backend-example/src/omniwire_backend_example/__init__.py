"""An omniwire data-plane backend in a package of its own: ``example_tcp``.

omniwire finds it through the entry point this package declares::

    [project.entry-points."omniwire.backends"]
    example_tcp = "omniwire_backend_example:TcpBackend"

Nothing here is imported until an endpoint (or ``omniwire backends``) asks for it.
"""

from __future__ import annotations

from ._backend import TcpBackend

__all__ = ["TcpBackend"]
__version__ = "0.1.0"
