"""A peer's inbox: the DataReadys it sent that wait to be taken, oldest first, indexed
by request id, so that an abort finds the items of its request without looking at
the others (a scan of every inbox per abort made each abort cost O(everything queued))."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import Generic, Protocol, TypeVar

__all__ = ["Inbox"]


class _Item(Protocol):
    @property
    def request_id(self) -> str: ...


T = TypeVar("T", bound=_Item)


class Inbox(Generic[T]):
    """A FIFO of items, each at most once (by identity), with O(1) append, removal of
    the head or of any item, membership, and lookup of the items of one request."""

    __slots__ = ("_by_request", "_items")

    def __init__(self) -> None:
        #: id(item) -> item, oldest first (the OrderedDict's head stays O(1) to find
        #: after deletions, a plain dict's does not)
        self._items: OrderedDict[int, T] = OrderedDict()
        #: request id -> ids of its items, oldest first
        self._by_request: dict[str, dict[int, None]] = {}

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def __iter__(self) -> Iterator[T]:
        return iter(self._items.values())

    def __contains__(self, item: object) -> bool:
        return self._items.get(id(item)) is item

    def append(self, item: T) -> None:
        """Queue ``item`` last (it must not be queued already)."""
        key = id(item)
        assert key not in self._items, "an item is queued once"
        self._items[key] = item
        rid = item.request_id
        ids = self._by_request.get(rid)
        if ids is None:
            ids = self._by_request[rid] = {}
        ids[key] = None

    def head(self) -> T:
        """The oldest item (IndexError when empty)."""
        for item in self._items.values():
            return item
        raise IndexError("head of an empty inbox")

    def popleft(self) -> T:
        """Remove and return the oldest item (IndexError when empty)."""
        if not self._items:
            raise IndexError("pop from an empty inbox")
        key, item = self._items.popitem(last=False)
        self._forget(key, item)
        return item

    def remove(self, item: T) -> None:
        """Remove ``item`` (ValueError if it is not queued)."""
        key = id(item)
        if self._items.get(key) is not item:
            raise ValueError("item is not in the inbox")
        del self._items[key]
        self._forget(key, item)

    def of_request(self, request_id: str) -> list[T]:
        """The items of ``request_id``, oldest first."""
        ids = self._by_request.get(request_id)
        return [] if ids is None else [self._items[key] for key in ids]

    def clear(self) -> None:
        self._items.clear()
        self._by_request.clear()

    def _forget(self, key: int, item: T) -> None:
        rid = item.request_id
        ids = self._by_request[rid]
        del ids[key]
        if not ids:
            del self._by_request[rid]
