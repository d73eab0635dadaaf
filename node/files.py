"""Files that survive kill -9: written whole or not at all, and fsynced before they count.

Torch-free, so that what only writes a snapshot (swarm statistics, addresses) does not load a model library.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import tempfile
from pathlib import Path

NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def no_space(exc: BaseException | None) -> bool:
    """Whether `exc` failed for want of disk space (a full disk, a quota), wherever the OSError hides: torch.save
    raises a RuntimeError ("unexpected pos") whose context is the OSError of the file it wrote, safetensors a
    SafetensorError that names only the OS error's number."""
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno in NO_SPACE:
            return True
        if any(f"(os error {code})" in str(exc) for code in NO_SPACE):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def os_error_reason(exc: OSError) -> str:
    """Why a file could not be written, as a user can act on it: a path under a file, a read-only file system, a full
    disk, a permission, or the OS's own words (or the message of one the node raised itself, without an errno)."""
    if exc.errno is None:
        return str(exc)
    if isinstance(exc, (NotADirectoryError, FileExistsError)) and exc.filename is not None:
        path = Path(exc.filename)
        blocking = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
        if blocking is not None:
            return f"{blocking} is a file, not a directory"
    if exc.errno == errno.EROFS:
        return "read-only file system"
    if exc.errno in NO_SPACE:
        return "no space left on device"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return f"permission denied ({exc.filename})" if exc.filename else "permission denied"
    reason = (exc.strerror or type(exc).__name__).lower()
    return f"{reason} ({exc.filename})" if exc.filename else reason


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


def write_snapshot(path: Path, text: str) -> bool:
    """atomic_write_text for a file rewritten again and again (counters, addresses): one the disk has no space for is
    skipped, False, and the next one carries the same and more. Other errors raise."""
    try:
        atomic_write_text(path, text)
    except OSError as exc:
        if not no_space(exc):
            raise
        return False
    return True


def append_json_line(path: Path, row: dict) -> None:
    """One JSON line appended whole and fsynced: processes side by side (benchmark seeds in one results file)
    append without interleaving, and a kill leaves at most a cut last line, which readers skip. A write that fails (a
    full disk) takes back what it wrote before it raises: the next line must not be glued to a cut one."""
    data = (json.dumps(row, separators=(",", ":")) + "\n").encode()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # a write() may be split on some file systems; the lock keeps lines whole
        size = os.fstat(fd).st_size
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        except OSError:
            os.ftruncate(fd, size)
            raise
    finally:
        os.close(fd)  # closing releases the lock
