"""What the process's C allocator does with the memory torch frees: keep it for the next call, or hand it back.

A stage server's forward and backward allocate their activations afresh on every call. With glibc's defaults the
memory they free goes back to the system between calls, and the next call takes it again one page fault at a time:
- the torch work runs in a worker thread (node/pipeline/handler.py), whose allocations land in a thread arena, and
  glibc shrinks and deletes a thread arena's heaps as soon as they are free;
- the dynamic mmap threshold and the trim threshold hand back large blocks and the heap's top;
- protobuf's upb runtime (hivemind's DHT and p2p daemon messages, in the same process) calls malloc_trim(0) every
  10,000 arena frees, which hands back every free page of every arena.
On a 27M stage server that was 2,800-4,900 minor page faults a call, and the same torch work cost 6-12 % more CPU than
in one process (benchmarks/notebook/2026-11-30-pipeline-throughput.md, "Run 6"). `keep_freed_memory` sets glibc's malloc
to keep what it frees: one arena for every thread (threads of one process share the GIL anyway), blocks up to 32 MiB
from the heap rather than mappings of their own, and a trim threshold high enough that the heap's top stays. Measured
side by side, it halves what a server's torch work costs beyond the same work in one process (+1-10 % CPU against +6-12
%). protobuf's malloc_trim still runs, and is the rest: with protobuf in pure Python the two cost the same, but a DHT
message then costs 17-69x more to parse, so that is left to the user (PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION).

The cost: a process keeps the memory of its busiest call until protobuf trims it.

A training node wants the opposite (`hand_back_freed_memory`): it runs for days, and each round's tensors come in
sizes that change with the sampled lengths. With glibc's defaults the mmap threshold rises to the largest block
freed (up to 32 MiB), so from the first round on almost every tensor is carved out of the heap, and the holes that
the next round's differently sized tensors do not fit only grow: a SmolLM2 node's resident memory grew by about
600 MB a round (2.8, 4.2, 5.0 GB after its first three rounds) with nothing of its own kept. A fixed threshold of
256 KiB gives every tensor beyond it a mapping of its own, handed back when it is freed: the same node stays at
2.7 GB after every round (benchmarks/node_memory.py measures it over an hour).

Nothing is done where the C library is not glibc, or where the user set the allocator's environment
(MALLOC_ARENA_MAX, MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_, GLIBC_TUNABLES): theirs wins.

Whatever the allocator does, what peers send must not take the process's memory past what its host can give it:
`MemoryBudget` (`swarm.rss_budget_mb`) reads the resident memory and, past the budget, drops the buffers peers fill
(each is bounded already, in messages and bytes; this is for a host the bounds together do not fit), then hands the
freed pages back (`malloc_trim`), and says so in one line. The node's own memory (its model, optimizer, the round in
flight) is never shed: past the budget with nothing of peers' left to drop, it says so once, and goes on.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import time
from dataclasses import dataclass
from typing import Callable

log = logging.getLogger(__name__)

# mallopt's parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8

MMAP_THRESHOLD_BYTES = 32 * 2**20  # glibc's largest: blocks up to this come from the heap and are reused
TRIM_THRESHOLD_BYTES = 2**30  # free memory at the heap's top kept up to this
USER_SETTINGS = ("MALLOC_ARENA_MAX", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")

SETTINGS = ((M_ARENA_MAX, 1), (M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES), (M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))

HAND_BACK_THRESHOLD_BYTES = 256 * 2**10  # blocks beyond it are mappings of their own, unmapped when freed
HAND_BACK_SETTINGS = ((M_MMAP_THRESHOLD, HAND_BACK_THRESHOLD_BYTES),)

NOTHING_TO_SHED_LOG_S = 600.0  # over the budget with nothing to shed: said at most once in this long


def keep_freed_memory() -> bool:
    """Set glibc's malloc to keep freed memory for reuse (module docstring). Call it before the process starts its
    threads: the arena limit applies to arenas not yet created. Returns whether the settings were applied."""
    return _apply(SETTINGS, "freed memory may still go back to the system between calls")


def hand_back_freed_memory() -> bool:
    """Set glibc's malloc to hand every block beyond 256 KiB back to the system when it is freed, so that a
    long-running trainer's resident memory does not grow with the heap's holes (module docstring). Call it before
    the model loads. Returns whether the setting was applied."""
    return _apply(HAND_BACK_SETTINGS, "a long run's resident memory may grow with the heap's holes")


def _apply(settings: tuple[tuple[int, int], ...], otherwise: str) -> bool:
    if platform.libc_ver()[0] != "glibc":
        return False
    user = [name for name in USER_SETTINGS if name in os.environ]
    if user:
        log.info("allocator left as the environment sets it (%s)", ", ".join(user))
        return False
    libc = ctypes.CDLL(None)  # the process's own C library: glibc here
    applied = all(libc.mallopt(parameter, value) == 1 for parameter, value in settings)  # mallopt: 1 on success
    if not applied:
        log.warning("glibc refused a malloc setting; %s", otherwise)
    return applied


def resident_bytes() -> int:
    """The process's resident memory now (its second field in /proc/self/statm is in pages; 0 where there is none)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def hand_back_free_pages() -> None:
    """glibc's malloc_trim(0): every free page of every arena goes back to the system (nothing elsewhere)."""
    if platform.libc_ver()[0] == "glibc":
        ctypes.CDLL(None).malloc_trim(0)


@dataclass(frozen=True)
class ShedReport:
    """One time the process was over its budget: its resident bytes before and after, and what was shed."""

    rss_before: int
    rss_after: int
    shed: dict[str, int]  # buffer's name -> bytes dropped


class MemoryBudget:
    """Keeps the process's resident memory under `limit_bytes` by dropping the buffers peers fill (module docstring).

    `sheds` are named functions, called in order, that each drop a buffer and return the bytes they dropped; call
    `check` every round (reading the resident size costs one small read of /proc). `resident` and `hand_back` are the
    process's own; tests give their own."""

    def __init__(
        self,
        limit_bytes: int,
        sheds: dict[str, Callable[[], int]],
        *,
        resident: Callable[[], int] = resident_bytes,
        hand_back: Callable[[], None] = hand_back_free_pages,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if limit_bytes < 1:
            raise ValueError(f"limit_bytes must be at least 1, got {limit_bytes}")
        self.limit_bytes = limit_bytes
        self.sheds = sheds
        self.resident = resident
        self.hand_back = hand_back
        self.clock = clock
        self.times_shed = 0
        self.bytes_shed = 0
        self.times_over_with_nothing_to_shed = 0
        self._said_nothing_to_shed_at: float | None = None

    def check(self) -> ShedReport | None:
        """Shed peers' buffers if the process is over its budget; the report of what was shed (None: not over, or
        nothing to shed)."""
        before = self.resident()
        if before <= self.limit_bytes:
            return None
        shed = {name: dropped for name, drop in self.sheds.items() if (dropped := drop())}
        if not shed:
            self.times_over_with_nothing_to_shed += 1
            now = self.clock()
            if self._said_nothing_to_shed_at is None or now - self._said_nothing_to_shed_at >= NOTHING_TO_SHED_LOG_S:
                self._said_nothing_to_shed_at = now
                log.warning(
                    "resident memory %d MiB is over the budget of %d MiB, and no peers' buffer holds anything to shed: "
                    "the node's own memory is the rest (raise swarm.rss_budget_mb, or give it a smaller model)",
                    before >> 20,
                    self.limit_bytes >> 20,
                )
            return None
        self.hand_back()
        report = ShedReport(before, self.resident(), shed)
        self.times_shed += 1
        self.bytes_shed += sum(shed.values())
        log.warning(
            "resident memory %d MiB was over the budget of %d MiB: shed %s; now %d MiB",
            report.rss_before >> 20,
            self.limit_bytes >> 20,
            ", ".join(f"{name} {dropped / 2**20:.1f} MiB" for name, dropped in shed.items()),
            report.rss_after >> 20,
        )
        return report
