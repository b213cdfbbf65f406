"""What sealed segments and checked opening cost (issue 19), in one process.

    PYTHONPATH=src OMP_NUM_THREADS=1 python scripts/shm_open_bench.py

Per figure, the median of ``--rounds`` runs: creating a 64 MiB segment (sealed memfd
behind a link vs a plain file), a receiver's first contact with one (checked open +
map without pre-faulting vs the old open + ``MAP_POPULATE``), and taking an object
out of it (a copy from the mapping vs ``pread`` from the descriptor, 64 MiB and
1 KiB; warm pages).
"""

from __future__ import annotations

import argparse
import mmap
import os
import secrets
import statistics
import time
from collections.abc import Callable

import numpy as np

from omniwire.backends._peermem import open_shared, pread_into
from omniwire.backends.shm import Segment

MiB = 1 << 20


def _median(fn: Callable[[], None], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    r = args.rounds
    prefix = f"omniwire-{os.getpid()}-{secrets.token_hex(4)}"
    n = iter(range(10**6))

    def create(sealed: bool) -> None:
        seg = Segment.create(f"{prefix}-{next(n)}", 64 * MiB, sealed=sealed)
        seg.unlink()
        seg.close()

    print(f"create 64 MiB, sealed memfd + link: {_median(lambda: create(True), r) * 1e3:7.2f} ms")
    print(f"create 64 MiB, plain file:          {_median(lambda: create(False), r) * 1e3:7.2f} ms")

    sealed = Segment.create(f"{prefix}-{next(n)}", 64 * MiB, sealed=True)
    plain = Segment.create(f"{prefix}-{next(n)}", 64 * MiB, sealed=False)
    try:

        def first_contact_new() -> None:
            opened = open_shared("/dev/shm", sealed.name, os.getpid(), True)
            seg = Segment.map(opened)
            opened.close()
            seg.close()

        def first_contact_old() -> None:  # what Segment.attach did before issue 19
            fd = os.open(f"/dev/shm/{plain.name}", os.O_RDWR)
            size = os.fstat(fd).st_size
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
            os.close(fd)
            mm.close()

        print(
            f"receiver, first contact, checked open + map: {_median(first_contact_new, r) * 1e6:8.1f} µs"
        )
        print(
            f"receiver, first contact, old open + POPULATE: {_median(first_contact_old, r) * 1e6:8.1f} µs"
        )

        opened = open_shared("/dev/shm", sealed.name, os.getpid(), True)
        mapped = Segment.map(opened)
        opened.close()
        plain_fd = open_shared("/dev/shm", plain.name, os.getpid()).fd
        for size, label in ((64 * MiB, "64 MiB"), (1024, "1 KiB")):
            dest = np.empty(size, dtype=np.uint8)
            view = mapped.base[:size].numpy()
            np.copyto(dest, view)  # warm both
            copy_t = _median(lambda d=dest, v=view: np.copyto(d, v), r * 5)
            pread_t = _median(lambda d=dest: pread_into(plain_fd, d.data, 0, "bench"), r * 5)
            print(
                f"take {label}: copy from the mapping {copy_t * 1e6:9.1f} µs "
                f"({size / copy_t / 1e9:5.2f} GB/s), pread {pread_t * 1e6:9.1f} µs "
                f"({size / pread_t / 1e9:5.2f} GB/s)"
            )
        mapped.close()
        os.close(plain_fd)
    finally:
        for seg in (sealed, plain):
            seg.unlink()
            seg.close()


if __name__ == "__main__":
    main()
