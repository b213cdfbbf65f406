"""``omniwire bench``: omniwire beside its baselines, two processes on one host.

Scenarios (``--scenarios``, default all, in this order), each measured through
the public Endpoint API between this process (A) and a peer process (B,
``python -m omniwire.peer --mode bench``, default routing), beside a baseline
measured in the same run; rounds alternate omniwire and baseline so that drift on
a shared machine falls on both, and a warm-up round of each is dropped:

  idle    CPU of B, an endpoint connected to A with nothing sent, over a few
          seconds (target ≤ 1 % of a core); baseline: the raw zmq.asyncio process.
  echo    1 KiB echo round trip: A sends {'x': 1 KiB tensor}, B's application
          sends it back, A receives it; p50/p99. Baseline: a raw zmq.asyncio echo
          of 1 KiB (PUSH/PULL both ways, asyncio on both sides). Targets ≤ 2×,
          stretch ≤ 0.5×.
  stream  1 KiB stream chunks one way, pipelined (each ep.stream() awaited) until
          B's application has them all; msgs/s. Baseline: a raw zmq.asyncio
          PUSH/PULL loop awaiting one send per message, the receiver counting then
          answering. Target ≥ 1×.
  mix     20 tasks in A each stream 200 chunks of 64 B–16 KiB (log-uniform,
          seeded) to B at once; total msgs/s and per-chunk latency p50/p99 (A's
          monotonic clock in the chunk's metadata, read by B's application).
          Baseline: the same 20 tasks sharing one raw zmq.asyncio PUSH socket.
  shm     64 MiB one-way over shm (send → ACK) to a copy-mode and a zero-copy
          receiver, beside memcpy (targets ≥ 0.5× and ≥ 0.8× memcpy).
  table   per backend (--backends), mode (copy; zero-copy for shm; lent for the
          cross-host engines) and size (--sizes): round trip p50/p99, one-way and
          streamed throughput, msgs/s, beside memcpy, a raw zmq.asyncio round trip
          and each bare engine (its transfers interleaved with the row's: ×raw);
          with shm, a large object behind a held 1 KiB one. A row that fails is
          reported and the table goes on.

--busy runs a CPU burner (one Python busy loop, normal priority) for the whole
run, so that the figures are those with the other core busy. Every bench process
runs with OMP_NUM_THREADS=1. --json writes every figure, its baseline and ratio
(omniwire ÷ baseline); --plot writes throughput, latency and ratio panels. The
exit status is 1 when something failed (it is reported; the rest still ran).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """``omniwire bench ARGS``; returns the exit status."""
    from ._cli import main as run_main

    return run_main(argv)
