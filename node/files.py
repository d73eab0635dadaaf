"""Files that survive kill -9: written whole or not at all, and fsynced before they count.

Torch-free, so that what only writes a snapshot (swarm statistics, addresses) does not load a model library.
"""

from __future__ import annotations

import fcntl
import json
import os
import tempfile
from pathlib import Path


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    for root, _, files in os.walk(path):
        for name in files:
            with open(Path(root) / name, "rb") as handle:
                os.fsync(handle.fileno())
        fsync_dir(Path(root))


def atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def append_json_line(path: Path, row: dict) -> None:
    """One JSON line appended whole and fsynced: processes side by side (benchmark seeds in one results file)
    append without interleaving, and a kill leaves at most a cut last line, which readers skip."""
    data = (json.dumps(row, separators=(",", ":")) + "\n").encode()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # a write() may be split on some file systems; the lock keeps lines whole
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)  # closing releases the lock
