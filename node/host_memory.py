"""What the process's C allocator does with the memory torch frees: keep it for the next call, or hand it back.

A stage server's forward and backward allocate their activations afresh on every call. With glibc's defaults the
memory they free goes back to the system between calls, and the next call takes it again one page fault at a time:
- the torch work runs in a worker thread (node/pipeline/handler.py), whose allocations land in a thread arena, and
  glibc shrinks and deletes a thread arena's heaps as soon as they are free;
- the dynamic mmap threshold and the trim threshold hand back large blocks and the heap's top;
- protobuf's upb runtime (hivemind's DHT and p2p daemon messages, in the same process) calls malloc_trim(0) every
  10,000 arena frees, which hands back every free page of every arena.
On a 27M stage server that was 2,800-4,900 minor page faults a call, and the same torch work cost 6-12 % more CPU
than in one process (benchmarks/RESULTS.md, pipeline_throughput "Run 6"). `keep_freed_memory` sets glibc's malloc to
keep what it frees: one arena for every thread (threads of one process share the GIL anyway), blocks up to 32 MiB
from the heap rather than mappings of their own, and a trim threshold high enough that the heap's top stays. Measured
side by side, it halves what a server's torch work costs beyond the same work in one process (+1-10 % CPU against
+6-12 %). protobuf's malloc_trim still runs, and is the rest: with protobuf in pure Python the two cost the same, but
a DHT message then costs 17-69x more to parse, so that is left to the user (PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION).

The cost: a process keeps the memory of its busiest call until protobuf trims it. Nothing is done where the C library
is not glibc, or where the user set the allocator's environment (MALLOC_ARENA_MAX, MALLOC_MMAP_THRESHOLD_,
MALLOC_TRIM_THRESHOLD_, GLIBC_TUNABLES): theirs wins.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

log = logging.getLogger(__name__)

# mallopt's parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8

MMAP_THRESHOLD_BYTES = 32 * 2**20  # glibc's largest: blocks up to this come from the heap and are reused
TRIM_THRESHOLD_BYTES = 2**30  # free memory at the heap's top kept up to this
USER_SETTINGS = ("MALLOC_ARENA_MAX", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")

SETTINGS = ((M_ARENA_MAX, 1), (M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES), (M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))


def keep_freed_memory() -> bool:
    """Set glibc's malloc to keep freed memory for reuse (module docstring). Call it before the process starts its
    threads: the arena limit applies to arenas not yet created. Returns whether the settings were applied."""
    if platform.libc_ver()[0] != "glibc":
        return False
    user = [name for name in USER_SETTINGS if name in os.environ]
    if user:
        log.info("allocator left as the environment sets it (%s)", ", ".join(user))
        return False
    libc = ctypes.CDLL(None)  # the process's own C library: glibc here
    applied = all(libc.mallopt(parameter, value) == 1 for parameter, value in SETTINGS)  # mallopt: 1 on success
    if not applied:
        log.warning("glibc refused a malloc setting; freed memory may still go back to the system between calls")
    return applied
