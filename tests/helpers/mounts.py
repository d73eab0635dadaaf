"""File systems a test mounts itself (a full disk, a read-only one) and unmounts when it ends; where this process may
not mount (not root, a container without CAP_SYS_ADMIN) the test is skipped, saying so."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def tmpfs(path: Path, size_mb: int, read_only: bool = False) -> Iterator[Path]:
    """A tmpfs of `size_mb` MB mounted at `path` (created) for the block's duration."""
    path.mkdir(parents=True, exist_ok=True)
    options = f"size={size_mb}m" + (",ro" if read_only else "")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip() or mounted.returncode}")
    try:
        yield path
    finally:
        # lazily: a model loaded from it may still map a file until it is collected; the mount goes with the last user
        subprocess.run(["umount", "--lazy", str(path)], check=True)


def fill(directory: Path) -> Path:
    """Write a file in `directory` until its file system has no space left; the file, to remove for space again."""
    filler = directory / "filler"
    chunk = b"\0" * (1 << 20)
    with open(filler, "wb", buffering=0) as handle:
        while True:
            try:
                handle.write(chunk)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                break
        with contextlib.suppress(OSError):  # the last pages' worth, below a chunk
            while handle.write(b"\0" * 4096):
                pass
    assert os.statvfs(directory).f_bavail == 0
    return filler
