"""A checkpoint store on another host, for stage_recovery's checkpoint-restart (--checkpoint-store-mbit).

In a swarm a checkpoint kept only on the node that dies is lost with it, so a deployment uploads each stage's
checkpoint to storage elsewhere and a replacement server downloads it. The store is a process in a network namespace
of its own (CheckpointStore), behind a link shaped to the rate; it writes what it receives to a temporary file of that
upload's own, fsyncs it and renames it over the last one before it answers (an upload cut short leaves the last one
whole). This module imports no torch, so that a store starts in well under a second on a loaded machine:
`python benchmarks/checkpoint_store.py FOLDER HOST PORT` serves until killed; `python benchmarks/checkpoint_store.py
--upload-loop FILE HOST PORT LOG` uploads FILE to a store until killed (pipeline_throughput's --lab-uploads).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import socket
import struct
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from node.files import fsync_dir  # noqa: E402

# One request per connection: PUT (b"P", name, length, bytes) -> b"K"; GET (b"G", name) -> length, bytes.
STORE_PORT = 7311
STORE_HEADER = ">cH"  # op, name length
STORE_LENGTH = ">Q"
UPLOADS = itertools.count()


async def store_serve(folder: Path, host: str, port: int) -> None:
    """The store's side, until killed."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            op, size = struct.unpack(STORE_HEADER, await reader.readexactly(struct.calcsize(STORE_HEADER)))
            name = (await reader.readexactly(size)).decode()
            if "/" in name or name.startswith("."):
                raise ValueError(f"bad name {name!r}")
            path = folder / name
            if op == b"P":
                (length,) = struct.unpack(STORE_LENGTH, await reader.readexactly(struct.calcsize(STORE_LENGTH)))
                # a file of this upload's own: an upload cut by its host's loss never mixes with the next of the name
                partial = path.with_name(f"{name}.{next(UPLOADS)}.partial")
                try:
                    with open(partial, "wb") as handle:
                        left = length
                        while left:
                            chunk = await reader.read(min(left, 1 << 20))
                            if not chunk:
                                raise ConnectionError("the upload ended early")
                            handle.write(chunk)
                            left -= len(chunk)
                        handle.flush()
                        os.fsync(handle.fileno())
                    os.replace(partial, path)
                finally:
                    partial.unlink(missing_ok=True)
                fsync_dir(folder)
                writer.write(b"K")
            elif op == b"G":
                data = path.read_bytes()
                writer.write(struct.pack(STORE_LENGTH, len(data)) + data)
            await writer.drain()
        finally:
            writer.close()

    folder.mkdir(parents=True, exist_ok=True)
    server = await asyncio.start_server(handle, host, port)
    async with server:
        await server.serve_forever()


async def until_listening(host: str, port: int, tries: int = 600, every_s: float = 0.1) -> None:
    """Return once a store accepts connections at host:port (a store process or task takes a moment to listen)."""
    for _ in range(tries):
        with contextlib.suppress(OSError):
            _, writer = await asyncio.open_connection(host, port)
            writer.close()
            return
        await asyncio.sleep(every_s)
    raise RuntimeError(f"the checkpoint store at {host}:{port} never listened")


async def store_put(host: str, port: int, path: Path) -> None:
    """Upload the file at `path` to the store under its name; returns once the store has it on disk."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        name = path.name.encode()
        data = await asyncio.to_thread(path.read_bytes)
        writer.write(struct.pack(STORE_HEADER, b"P", len(name)) + name + struct.pack(STORE_LENGTH, len(data)))
        writer.write(data)
        await writer.drain()
        if await reader.readexactly(1) != b"K":
            raise RuntimeError(f"the store did not acknowledge {path.name}")
    finally:
        writer.close()


async def store_get(host: str, port: int, path: Path) -> None:
    """Download the file named like `path` from the store and write it there."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        name = path.name.encode()
        writer.write(struct.pack(STORE_HEADER, b"G", len(name)) + name)
        await writer.drain()
        (length,) = struct.unpack(STORE_LENGTH, await reader.readexactly(struct.calcsize(STORE_LENGTH)))
        data = await reader.readexactly(length)
    finally:
        writer.close()
    await asyncio.to_thread(path.write_bytes, data)


STORE_NET = "198.19"  # the other half of RFC 2544's benchmarking range (the lab uses 198.18 and 198.20)
STORE_PREFIX = "ckst"  # then the owner's process id, "x" and an index: remove_stale_stores finds the dead owners'
STORE_INDEX = itertools.count()  # stores of one process: each its own names and addresses


def start_store(prefix: list[str], scratch: Path, name: str, host: str, port: int) -> subprocess.Popen:
    """The store's process (`prefix` + this file), in a process group of its own, logging to scratch/<name>.log."""
    with open(scratch / f"{name}.log", "ab") as log:
        return subprocess.Popen(
            [*prefix, sys.executable, str(Path(__file__).resolve()), str(scratch / name), host, str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def stop_store(process: subprocess.Popen | None) -> None:
    if process is not None and process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)


class CheckpointStore:
    """The store in a network namespace of its own, joined to this host by a veth pair whose two ends are shaped to
    `mbit` (tbf; root). Its names and its /30 come from this process's id, so it runs beside a lab, another store or a
    test's (no bridge, no shared host address); a store whose owner died is removed by the next one (by that id)."""

    def __init__(self, mbit: float, scratch: Path, name: str = "store") -> None:
        from benchmarks.lab import _run, _tbf, lab_unavailable

        why = lab_unavailable()
        if why:
            raise RuntimeError(f"--checkpoint-store-mbit: {why}")
        remove_stale_stores()
        pid, index = os.getpid(), next(STORE_INDEX)
        self.ns = f"{STORE_PREFIX}{pid}x{index}"  # with "h"/"s", within the 15 characters of an interface name
        base = 4 * ((8 * pid + index) % 16384)
        host_ip = f"{STORE_NET}.{base // 256}.{base % 256 + 1}"
        self.host, self.port = f"{STORE_NET}.{base // 256}.{base % 256 + 2}", STORE_PORT
        self.process: subprocess.Popen | None = None
        try:
            _run("ip", "netns", "add", self.ns)
            _run("ip", "link", "add", f"{self.ns}h", "type", "veth", "peer", "name", f"{self.ns}s")
            _run("ip", "link", "set", f"{self.ns}s", "netns", self.ns)
            _run("ip", "addr", "add", f"{host_ip}/30", "dev", f"{self.ns}h")
            _run("ip", "link", "set", f"{self.ns}h", "up")
            _run("ip", "-n", self.ns, "addr", "add", f"{self.host}/30", "dev", f"{self.ns}s")
            _run("ip", "-n", self.ns, "link", "set", f"{self.ns}s", "up")
            _run("ip", "-n", self.ns, "link", "set", "lo", "up")
            _run("tc", "qdisc", "add", "dev", f"{self.ns}h", "root", *_tbf(mbit))  # uploads
            _run("tc", "-n", self.ns, "qdisc", "add", "dev", f"{self.ns}s", "root", *_tbf(mbit))  # downloads
            self.process = start_store(["ip", "netns", "exec", self.ns], scratch, name, self.host, self.port)
        except BaseException:
            self.close()
            raise

    async def ready(self) -> None:
        await until_listening(self.host, self.port)

    def close(self) -> None:
        """Stop the store's process (by its process group) and delete its namespace, which takes the veth pair along."""
        stop_store(self.process)
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True)


class LoopbackStore:
    """A store on this network namespace's loopback, at a port of its own: where the namespace is a run's own and its
    loopback is shaped per host (host_uplinks.HostUplinks), the store is a host there and the shaping is its link."""

    def __init__(self, scratch: Path, name: str = "store") -> None:
        self.host = "127.0.0.1"
        with socket.socket() as probe:  # a free port; the store binds it a moment later (nothing else in the namespace
            probe.bind((self.host, 0))  # takes ports but the run's p2p daemons, at ports of their own choice)
            self.port = probe.getsockname()[1]
        self.process: subprocess.Popen | None = start_store([], scratch, name, self.host, self.port)

    async def ready(self) -> None:
        await until_listening(self.host, self.port)

    def close(self) -> None:
        stop_store(self.process)


def remove_stale_stores() -> list[str]:
    """Delete the namespaces of checkpoint stores whose owner process is gone (and stop what still runs in them)."""
    from benchmarks.lab import remove_stale_namespaces

    return remove_stale_namespaces(STORE_PREFIX)


async def upload_loop(path: Path, host: str, port: int, log: Path) -> None:
    """Upload `path` to the store again and again until killed, appending each upload's seconds to `log`: a host whose
    uplink always carries a checkpoint, as uploads in the background keep it when they take longer than the steps
    between saves (stage_recovery at 27M: 36 s an upload, a save every 4-6 steps of 5-15 s)."""
    loop = asyncio.get_running_loop()
    while True:
        started = loop.time()
        await store_put(host, port, path)
        with open(log, "a") as out:
            out.write(f"{loop.time() - started:.3f}\n")


if __name__ == "__main__":
    if sys.argv[1] == "--upload-loop":  # FILE HOST PORT LOG
        path, host, port, log = sys.argv[2:6]
        asyncio.run(upload_loop(Path(path), host, int(port), Path(log)))
    else:  # FOLDER HOST PORT
        folder, host, port = sys.argv[1:4]
        asyncio.run(store_serve(Path(folder), host, int(port)))
