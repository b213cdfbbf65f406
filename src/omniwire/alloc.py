"""A buddy allocator over a fixed region: O(log n) allocate and free, no scan.

Backends use it to carve reusable slots out of a pool allocated once (a shared
memory arena, a registered Mooncake/NIXL pool, a CUDA slot pool). It only hands
out offsets; it never touches memory. Not thread-safe: call it from one thread
(the event loop).
"""

from __future__ import annotations

__all__ = ["BuddyAllocator"]


class BuddyAllocator:
    """Blocks of ``min_block * 2**k`` bytes inside a region of ``capacity`` bytes.

    ``capacity`` is rounded down to a multiple of ``min_block``; a region that is
    not a power of two is covered by several top-level blocks.
    """

    def __init__(self, capacity: int, min_block: int = 4096) -> None:
        if min_block <= 0 or min_block & (min_block - 1):
            raise ValueError("min_block must be a power of two")
        self.min_block = min_block
        self.capacity = capacity // min_block * min_block
        self.max_order = max(0, (self.capacity // min_block).bit_length() - 1)
        self._free: list[set[int]] = [set() for _ in range(self.max_order + 1)]
        self._used: dict[int, int] = {}  # offset -> order
        offset = 0
        for order in range(self.max_order, -1, -1):  # cover the region greedily
            size = min_block << order
            while offset + size <= self.capacity:
                self._free[order].add(offset)
                offset += size
        self.bytes_in_use = 0

    def _order(self, nbytes: int) -> int:
        blocks = max(1, -(-nbytes // self.min_block))
        return (blocks - 1).bit_length()

    def block_size(self, nbytes: int) -> int:
        """The size of the block ``allocate(nbytes)`` would return."""
        return self.min_block << self._order(nbytes)

    def fits(self, nbytes: int) -> bool:
        """Whether :meth:`allocate` of ``nbytes`` would find a block now."""
        order = self._order(nbytes)
        return any(self._free[k] for k in range(order, self.max_order + 1))

    def allocate(self, nbytes: int) -> int | None:
        """Return the offset of a free block of at least ``nbytes``, or None if none fits."""
        order = self._order(nbytes)
        if order > self.max_order:
            return None
        k = order
        while k <= self.max_order and not self._free[k]:
            k += 1
        if k > self.max_order:
            return None
        offset = self._free[k].pop()
        while k > order:  # split, keeping the upper halves free
            k -= 1
            self._free[k].add(offset + (self.min_block << k))
        self._used[offset] = order
        self.bytes_in_use += self.min_block << order
        return offset

    def free(self, offset: int) -> None:
        """Return a block. Raises KeyError for an offset that is not allocated."""
        order = self._used.pop(offset)
        self.bytes_in_use -= self.min_block << order
        while order < self.max_order:
            size = self.min_block << order
            buddy = offset ^ size
            if buddy + size > self.capacity or buddy not in self._free[order]:
                break
            self._free[order].remove(buddy)
            offset = min(offset, buddy)
            order += 1
        self._free[order].add(offset)

    @property
    def allocations(self) -> int:
        return len(self._used)
