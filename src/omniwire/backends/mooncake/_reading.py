"""The mooncake receiver side: an import that reads the peer's spans with the engine,
into the caller's destination or a landing slot of our registered pool."""

from __future__ import annotations

from typing import TYPE_CHECKING

import anyio
import torch

from ... import hops
from ...errors import BackendError
from ..base import Import, PeerInfo, copy_range
from ..pool import Lease
from ..support import TransferAbandonedError, TransferTimeoutError, check_range
from ._engine import Engine, Reads, submit
from ._memory import Registered

if TYPE_CHECKING:
    from ._backend import MooncakeBackend

__all__ = ["SpanImport"]


class SpanImport(Import):
    """Reads of the peer's spans, into ``dest`` or into a landing slot of our pool."""

    def __init__(
        self,
        backend: MooncakeBackend,
        peer: PeerInfo,
        nbytes: int,
        session: str,
        spans: list[tuple[int, int, int]],
    ) -> None:
        super().__init__(backend, peer, nbytes)
        self.mc = backend
        self.session = session
        self.spans = spans
        self.landing: Lease[Registered] | None = None
        self.busy = 0
        if nbytes == 0:
            self.buffer = torch.empty(0, dtype=torch.uint8)

    async def fetch(self, lo: int, hi: int, dest: torch.Tensor | None = None) -> None:
        mc = self.mc
        engine = mc._check_open()
        if self.closed:
            raise BackendError("mooncake: fetch() on a closed import")
        if self.peer.key not in mc._peers:
            raise BackendError(f"mooncake: {self.peer.name!r} is gone (disconnected)")
        check_range(lo, hi, self.nbytes, "mooncake")
        if hi == lo:
            return
        held = dest is not None and mc._recv_pool is not None and mc._recv_pool.holds(dest)
        direct = (
            dest is not None
            and (mc.register_dest or held)
            and dest.device.type == "cpu"
            and dest.dtype == torch.uint8
            and dest.dim() == 1
            and dest.is_contiguous()
            and dest.numel() >= hi
        )
        self.busy += 1
        mc._enter()
        try:
            if direct:
                assert dest is not None
                local = dest[lo:hi].data_ptr() - lo
                await self._read(engine, local, lo, hi, register=not held, dest=dest)
            else:
                landing = self.landing
                if landing is None:
                    landing = self.landing = await mc.pool.take(
                        self.nbytes, purpose=f"from {self.peer.name!r}"
                    )
                    self.buffer = mc._view(landing)
                base = landing.buffer.addr if landing.buffer is not None else mc._pool_addr
                try:
                    await self._read(engine, base + max(landing.offset, 0), lo, hi)
                except (TransferTimeoutError, TransferAbandonedError):
                    self.landing = None  # never reused: the read may still land in it
                    landing.quarantine()
                    raise
                if dest is not None:
                    assert self.buffer is not None
                    await copy_range(dest, self.buffer, lo, hi)
        finally:
            self.busy -= 1
            mc._leave()
            self._settle()  # closed meanwhile: give the landing back now
        mc.counters["reads"] += 1
        mc.counters["bytes_read"] += hi - lo

    async def _read(
        self,
        engine: Engine,
        local: int,
        lo: int,
        hi: int,
        *,
        register: bool = False,
        dest: torch.Tensor | None = None,
    ) -> None:
        """Read bytes ``[lo, hi)`` of the object to ``local + lo`` and onwards (into
        ``dest``'s memory, registered for this read when ``register``; an abandoned
        read keeps ``dest``).

        Registration (none for memory registered already: the landing slot, the
        registered receive pool's blocks) and the submit are one call in one of the
        backend's threads (:class:`~omniwire.backends.threads.Threads`; not on the
        event loop: the TCP transport may connect to the peer inside its submit call,
        which blocks while a link is down); that thread hands the reads to the
        backend's one :class:`~omniwire.backends.completion.Completions` thread, which
        waits for every read in flight (a thread polling per read, dozens of them while
        objects stream, took the cores from the engine) and wakes the loop once, when
        the reads ended (``start_and_wait``).
        """
        reads = []
        for at, remote, length in self.spans:
            a, b = max(lo, at), min(hi, at + length)
            if a < b:
                reads.append((local + a, remote + (a - at), b - a))
        timeout = self.mc.timeout + (hi - lo) / 100e6
        peer = self.peer
        mc = self.mc
        session = self.session

        def lost() -> bool:
            return peer.key not in mc._peers

        submitted = False  # start() returned: its failures unregister themselves
        started: list[Reads] = []  # the batch start() submitted

        def start() -> Reads:
            nonlocal submitted
            if register:
                engine.register(local + lo, hi - lo)
            hops.mark("engine: submit (worker thread)")
            try:
                batch = submit(engine, session, reads, timeout)
                started.append(batch)
                submitted = True
                return batch
            except TransferTimeoutError:
                raise  # it may still land: the memory stays registered, see _abandoned
            except BaseException:
                if register:  # the engine ended every read it took: nothing will land
                    engine.unregister(local + lo)
                raise

        ended = False  # every read ended (done or failed): nothing lands later
        try:
            # Like a worker thread's call: a cancellation lands once every read ended
            # (or timed out: then its memory is abandoned below), never while the
            # engine may write into memory the caller would reuse.
            with anyio.CancelScope(shield=True):
                try:
                    batch = await mc._completions.start_and_wait(
                        mc._threads,
                        start,
                        timeout=timeout,
                        what=f"mooncake: read of {hi - lo} bytes from session {session}",
                        cancelled=lost,
                        nbytes=hi - lo,
                    )
                except BackendError as exc:
                    ended = submitted and not isinstance(
                        exc, (TransferTimeoutError, TransferAbandonedError)
                    )
                    raise
            ended = True
            hops.mark("engine: back on the loop")
            batch.check()
        except (TransferTimeoutError, TransferAbandonedError) as exc:
            mc._warm.pop(session, None)  # its connection may be gone: see MooncakeBackend._write
            if dest is not None:
                # the caller's memory: kept referenced (so not reused), and registered
                # if registered for this read
                mc._abandoned.append((dest, local + lo if register else None))
            raise type(exc)(
                f"{exc} (peer {peer.name!r}, bytes [{lo}, {hi}) of a {self.nbytes}-byte object)"
            ) from None
        except BackendError as exc:
            mc._warm.pop(session, None)
            raise type(exc)(
                f"{exc} (peer {peer.name!r}, bytes [{lo}, {hi}) of a {self.nbytes}-byte object)"
            ) from None
        except BaseException:
            # A plain Task.cancel(): the wait ended with the reads' watch (done, failed
            # or given up), and its outcome went nowhere. No read pending: they ended,
            # unregister below. Else it may still land: abandoned, as on a timeout.
            if submitted and not ended:
                if started and not started[0].pending:
                    ended = True
                elif dest is not None:
                    mc._abandoned.append((dest, local + lo if register else None))
            raise
        finally:
            if register and ended:
                await mc._threads.run(lambda: engine.unregister(local + lo))

    def _close(self) -> None:
        self._settle()

    def _settle(self) -> None:
        """Once closed and no read is in flight, the landing slot is free."""
        if self.closed and not self.busy:
            landing, self.landing = self.landing, None
            if landing is not None:
                landing.release()
