"""nccl's per-object state: what a link keeps for each object in flight — the
sender's (:class:`Outbound`), the receiver's (:class:`Inbound`), and the ordered
channel's posted header receives (:class:`Header`, on tag :data:`CTL_TAG`)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import torch

from ...errors import BackendError
from ._blobs import Device, PiecesRef
from ._engine import Work

if TYPE_CHECKING:
    from ._link import Link

__all__ = ["CTL_TAG", "Header", "Inbound", "Outbound"]

CTL_TAG = 0  # gloo tag of the ordered channel's headers


class Outbound:
    """Sender state of one object: one tensor (packed), or one per piece (lent), sent
    under tags ``tag``, ``tag + 1``, …"""

    __slots__ = (
        "device",
        "event",
        "freed",
        "link",
        "nbytes",
        "ordered",
        "posted",
        "published",
        "tag",
        "tensors",
        "works",
    )

    def __init__(
        self,
        link: Link,
        tag: int,
        nbytes: int,
        device: Device,
        ordered: bool,
        tensors: list[torch.Tensor],
    ) -> None:
        self.link = link
        self.tag = tag
        self.nbytes = nbytes
        self.device: Device = device
        self.ordered = ordered
        self.tensors: list[torch.Tensor] = tensors
        self.event: Any = None
        self.works: list[tuple[Work, torch.Tensor]] = []
        self.published = False
        self.posted = False
        self.freed = False


class Inbound:
    """Receiver state of one object."""

    __slots__ = (
        "consume",
        "data",
        "device",
        "done",
        "error",
        "future",
        "link",
        "loop",
        "nbytes",
        "ordered",
        "pieces",
        "posted",
        "tag",
        "target",
        "works",
    )

    def __init__(self, link: Link, ref: PiecesRef) -> None:
        self.link = link
        self.tag = ref.tag
        self.nbytes = ref.nbytes
        self.device: Device = ref.device
        self.ordered = ref.ordered
        self.pieces = list(ref.pieces)  # empty: one message of nbytes
        self.target: torch.Tensor | None = None  # where the bytes land
        self.data: torch.Tensor | None = None  # the received bytes, once done
        self.consume = False  # nobody wants the bytes: receive into scratch
        self.posted = False
        self.done = False
        self.error: BackendError | None = None
        self.works: list[Work] = []
        self.loop: asyncio.AbstractEventLoop | None = None
        self.future: asyncio.Future[None] | None = None

    def messages(self, target: torch.Tensor) -> list[tuple[torch.Tensor, int]]:
        """Where each message lands in ``target``, with its tag."""
        if not self.pieces:
            return [(target[: self.nbytes], self.tag)]
        return [(target[at : at + n], self.tag + i) for i, (at, n) in enumerate(self.pieces)]


class Header:
    """A posted receive of one ordered-channel header."""

    __slots__ = ("tensor", "work")

    def __init__(self, work: Work, tensor: torch.Tensor) -> None:
        self.work = work
        self.tensor = tensor
