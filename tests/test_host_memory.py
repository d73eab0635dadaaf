"""node/host_memory.py: glibc's malloc set to keep what torch frees (one arena, large blocks from the heap), or to hand
back every large block when it is freed (a fixed mmap threshold).

Each case runs in a fresh interpreter, since the settings are process-wide and the arena limit applies to arenas not
yet created. The probe allocates (and touches) an 8 MiB block in each of three threads and reads glibc's own account
(malloc_info): how many arenas hold heaps, and how much is in blocks mapped on their own."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

PROBE = r"""
import ctypes, json, os, re, sys, tempfile, threading
sys.path.insert(0, sys.argv[1])
applied = None
if sys.argv[2] == "keep":
    from node.host_memory import keep_freed_memory
    applied = keep_freed_memory()
if sys.argv[2] == "hand_back":
    from node.host_memory import hand_back_freed_memory
    applied = hand_back_freed_memory()
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.fdopen.restype, libc.fdopen.argtypes = ctypes.c_void_p, [ctypes.c_int, ctypes.c_char_p]
libc.malloc_info.argtypes, libc.fflush.argtypes = [ctypes.c_int, ctypes.c_void_p], [ctypes.c_void_p]
BLOCK = 8 * 2**20
if len(sys.argv) > 3 and sys.argv[3] == "after_a_free":  # glibc's dynamic threshold rises to a freed mapping's size
    libc.free.argtypes = [ctypes.c_void_p]
    libc.free(libc.malloc(BLOCK))
held = []
def allocate():
    block = libc.malloc(BLOCK)
    ctypes.memset(block, 1, BLOCK)
    held.append(block)
threads = [threading.Thread(target=allocate) for _ in range(3)]
for thread in threads:
    thread.start()
    thread.join()
report = tempfile.TemporaryFile()
stream = libc.fdopen(os.dup(report.fileno()), b"w")
libc.malloc_info(0, stream)
libc.fflush(stream)
report.seek(0)
xml = report.read().decode()
mapped = re.search(r'<total type="mmap" count="(\d+)" size="(\d+)"/>', xml)
print(json.dumps({"applied": applied, "heaps": len(re.findall(r"<heap nr=", xml)), "mapped_bytes": int(mapped[2])}))
"""
BLOCK = 8 * 2**20

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc is what is being set")


def probe(mode: str, env: dict[str, str] | None = None, before: str = "") -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(REPO), mode, before],
        env={**clean, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_kept_memory_puts_every_threads_blocks_in_one_heap_and_none_in_mappings_of_their_own():
    default, kept = probe("default"), probe("keep")
    # glibc's defaults, the control: a thread arena for each thread, and an 8 MiB block above the 128 KiB mmap
    # threshold gets a mapping of its own, handed back to the system when freed
    assert default["heaps"] >= 2
    assert default["mapped_bytes"] >= 3 * BLOCK
    assert kept["applied"] is True
    assert kept["heaps"] == 1
    assert kept["mapped_bytes"] < BLOCK  # what the interpreter mapped before the setting, not the three blocks


def test_an_allocator_the_user_set_in_the_environment_is_left_alone():
    kept = probe("keep", {"MALLOC_ARENA_MAX": "4"})
    assert kept["applied"] is False
    assert kept["mapped_bytes"] >= 3 * BLOCK  # glibc's own mmap threshold still applies


def test_handed_back_memory_keeps_large_blocks_in_mappings_of_their_own_after_one_is_freed():
    """The growth a training node saw: once an 8 MiB mapping is freed, glibc serves the next 8 MiB blocks from the
    heap (whose holes are never handed back); with the threshold fixed they stay mappings, unmapped when freed."""
    default, handed_back = probe("default", before="after_a_free"), probe("hand_back", before="after_a_free")
    assert default["mapped_bytes"] < BLOCK  # the control: the heap took them
    assert handed_back["applied"] is True
    assert handed_back["mapped_bytes"] >= 3 * BLOCK
