"""This process's GPUs by index and by UUID: a peer names a GPU by its UUID, which
must stand for the same GPU here."""

from __future__ import annotations

from collections.abc import Iterable

from ...errors import BackendError
from ...wire import DeviceInfo
from ..base import PeerInfo

__all__ = ["DeviceIds"]


class DeviceIds:
    """The UUID of each GPU of this process, and the index of each UUID."""

    def __init__(self) -> None:
        self.uuid_by_index: dict[int, str] = {}
        self.index_by_uuid: dict[str, int] = {}

    def learn(self, devices: Iterable[DeviceInfo], device: int) -> None:
        """Record this process's GPUs, of which ``device`` must be one.

        Raises:
            BackendError: ``device`` is not one of them.
        """
        for d in devices:
            if d.kind == "cuda":
                # Without a UUID (old drivers) fall back to the index, as
                # torch.multiprocessing does: both ends must then number GPUs alike.
                self.uuid_by_index[d.index] = d.uuid or f"cuda-index-{d.index}"
        self.index_by_uuid = {u: i for i, u in self.uuid_by_index.items()}
        if device not in self.uuid_by_index:
            raise BackendError(
                f"cuda_ipc: device {device} is not one of this process's GPUs "
                f"({sorted(self.uuid_by_index)})"
            )

    def uuid_of(self, index: int) -> str:
        try:
            return self.uuid_by_index[index]
        except KeyError:
            raise BackendError(f"cuda:{index} is not a GPU this process knows") from None

    def index_of(self, uuid: str, peer: PeerInfo) -> int:
        index = self.index_by_uuid.get(uuid)
        if index is None:
            raise BackendError(
                f"GPU {uuid[:64]!r} of {peer.name!r} is not visible in this process "
                "(check CUDA_VISIBLE_DEVICES on both ends)"
            )
        return index
