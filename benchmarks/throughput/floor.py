"""--transport-floor: what the wire alone costs a call, a framed echo through two p2p daemons and through plain TCP
(on loopback, or with --lab between two of the lab's namespaces)."""

from __future__ import annotations

import asyncio
import enum
import json
import os
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from benchmarks.common import REPO
from benchmarks.lab import Lab, Link
from benchmarks.throughput.lab_runs import wait_lab_node
from node.transport import hivemind_p2p

FLOOR_BYTES = [4_096, 65_536, 262_144, 1_048_576, 4_194_304]  # a 4 KB control call to 4 MB (27M's hidden states of a
# micro-batch are 1 MB in float32, its logits' gradient 0.2 MB)
SCRIPT = REPO / "benchmarks" / "pipeline_throughput.py"  # each end of the lab's floor runs it with --floor-peer


class FloorFrame(enum.IntEnum):
    DATA = 1


def _floor_limit(sizes: list[int]):
    return lambda kind: max(sizes) + 1


async def _floor_echo(reader, writer, sizes: list[int]) -> None:
    from node.transport.framing import read_frame, write_frame

    try:
        _, body = await read_frame(reader, FloorFrame, _floor_limit(sizes))
        await write_frame(writer, FloorFrame.DATA, body)
    finally:
        writer.close()


async def _floor_round_trip(reader, writer, body: bytes, sizes: list[int]) -> None:
    from node.transport.framing import read_frame, write_frame

    try:
        await write_frame(writer, FloorFrame.DATA, body)
        _, back = await read_frame(reader, FloorFrame, _floor_limit(sizes))
    finally:
        writer.close()
    if back != body:  # the figures are only worth something if the bytes came back whole
        raise RuntimeError(f"the echo of {len(body)} bytes came back as {len(back)} different bytes")


async def transport_floor(sizes: list[int], calls: int) -> dict:
    """What a pipeline call's bytes cost on the wire with no compute: a framed echo (node/transport/framing.py, as
    call_stage and StageHandler frame a call) of each size, through two p2p daemons on 127.0.0.1 (a stream per call,
    as call_stage opens one) and through a plain TCP connection on 127.0.0.1 (a connection per call), interleaved call
    by call. Round trip medians, and the CPU seconds per call of this process (both ends' Python) and of the two p2p
    daemons (for the TCP way that is their background work: the DHT's upkeep)."""
    import psutil
    from hivemind.p2p import P2P

    def echo(reader, writer):
        return _floor_echo(reader, writer, sizes)

    def round_trip(reader, writer, body: bytes):
        return _floor_round_trip(reader, writer, body, sizes)

    server = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    client = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=await server.get_visible_maddrs())
    tcp = await asyncio.start_server(echo, "127.0.0.1", 0)
    port = tcp.sockets[0].getsockname()[1]
    await server.add_binary_stream_handler("floor", lambda info, reader, writer: echo(reader, writer))
    daemons = [psutil.Process(hivemind_p2p.daemon_process(p2p).pid) for p2p in (server, client)]

    def daemons_cpu_s() -> float:
        return sum(sum(daemon.cpu_times()[:2]) for daemon in daemons)  # user + system

    rows = {}
    try:
        for size in sizes:
            body = os.urandom(size)
            times: dict[str, list[float]] = {"p2p": [], "tcp": []}
            cpu = {"p2p": [0.0, 0.0], "tcp": [0.0, 0.0]}  # [this process, the two daemons]
            for call in range(calls + 1):  # the first call of each way warms it up and is not counted
                for way in ("p2p", "tcp"):
                    before = (time.process_time(), daemons_cpu_s(), time.perf_counter())
                    if way == "p2p":
                        _, reader, writer = await client.call_binary_stream_handler(server.peer_id, "floor")
                    else:
                        reader, writer = await asyncio.open_connection("127.0.0.1", port)
                    await round_trip(reader, writer, body)
                    wall = time.perf_counter() - before[2]
                    if call:
                        times[way].append(wall)
                        cpu[way][0] += time.process_time() - before[0]
                        cpu[way][1] += daemons_cpu_s() - before[1]
            row = {}
            for way in ("p2p", "tcp"):
                median = statistics.median(times[way])
                row[way] = {
                    "round_trip_ms": 1000 * median,
                    "mb_per_s_each_way": size / median / 1e6,
                    "python_cpu_ms": 1000 * cpu[way][0] / calls,
                    "daemons_cpu_ms": 1000 * cpu[way][1] / calls,
                }
            row["p2p_excess_ms"] = row["p2p"]["round_trip_ms"] - row["tcp"]["round_trip_ms"]
            rows[size] = row
            print(
                f"{size:>9} B  p2p {row['p2p']['round_trip_ms']:7.2f} ms ({row['p2p']['mb_per_s_each_way']:6.0f} MB/s, "
                f"CPU ms: python {row['p2p']['python_cpu_ms']:5.2f}, daemons {row['p2p']['daemons_cpu_ms']:5.2f})  "
                f"tcp {row['tcp']['round_trip_ms']:7.2f} ms ({row['tcp']['mb_per_s_each_way']:6.0f} MB/s, CPU ms: "
                f"python {row['tcp']['python_cpu_ms']:5.2f})  p2p - tcp {row['p2p_excess_ms']:6.2f} ms",
                flush=True,
            )
    finally:
        tcp.close()
        await tcp.wait_closed()
        await client.shutdown()
        await server.shutdown()
    return {"calls": calls, "bytes": rows}


async def floor_peer(role: str, ip: str, addresses: Path, sizes: list[int], calls: int, gap_s: float) -> None:
    """One end of `lab_floor`, run inside a lab namespace. `serve`: a p2p daemon and a TCP server at `ip`, both
    echoing (their addresses written to `addresses`), until killed. `call`: each size `calls` + 1 times (the first
    warms up) through both, interleaved, after `gap_s` of quiet each time (a pipeline call follows a stage's compute,
    and TCP restarts its congestion window after an idle gap); prints one JSON line: size -> way -> seconds."""
    from hivemind.p2p import P2P, PeerID

    if role == "serve":
        server = await P2P.create(host_maddrs=[f"/ip4/{ip}/tcp/0"])
        await server.add_binary_stream_handler("floor", lambda info, reader, writer: _floor_echo(reader, writer, sizes))
        tcp = await asyncio.start_server(lambda reader, writer: _floor_echo(reader, writer, sizes), ip, 0)
        maddrs = [str(m) for m in await server.get_visible_maddrs()]
        ready = {"maddrs": maddrs, "peer_id": server.peer_id.to_base58(), "tcp_port": tcp.sockets[0].getsockname()[1]}
        addresses.with_suffix(".tmp").write_text(json.dumps(ready))
        addresses.with_suffix(".tmp").rename(addresses)
        await asyncio.Event().wait()
    ready = json.loads(addresses.read_text())
    client = await P2P.create(host_maddrs=[f"/ip4/{ip}/tcp/0"], initial_peers=ready["maddrs"])
    server_id = PeerID.from_base58(ready["peer_id"])
    server_ip = ready["maddrs"][0].split("/")[2]
    times: dict[int, dict[str, list[float]]] = {}
    try:
        for size in sizes:
            body = os.urandom(size)
            times[size] = {"p2p": [], "tcp": []}
            for call in range(calls + 1):
                for way in ("p2p", "tcp"):
                    await asyncio.sleep(gap_s)
                    started = time.perf_counter()
                    if way == "p2p":
                        _, reader, writer = await client.call_binary_stream_handler(server_id, "floor")
                    else:
                        reader, writer = await asyncio.open_connection(server_ip, ready["tcp_port"])
                    await _floor_round_trip(reader, writer, body, sizes)
                    if call:
                        times[size][way].append(time.perf_counter() - started)
    finally:
        await client.shutdown()
    print(json.dumps(times), flush=True)


TCP_TROUBLE = ("TcpRetransSegs", "TcpExtTCPTimeouts", "TcpExtTCPLossProbes")


def tcp_counters(namespace: str) -> Counter:
    """This namespace's TCP counters of trouble (nstat, absolute): a shaped link that drops would show here."""
    out = subprocess.run(
        ["ip", "netns", "exec", namespace, "nstat", "-az", *TCP_TROUBLE], capture_output=True, text=True, check=True
    ).stdout
    return Counter({f[0]: int(f[1]) for f in (line.split() for line in out.splitlines()) if f and f[0] in TCP_TROUBLE})


def lab_floor(rates: list[float], sizes: list[int], calls: int, gap_s: float, root: Path) -> dict:
    """The transport floor across the lab (benchmarks/lab/, root): the same framed echo as `transport_floor`,
    from one namespace to another over links shaped to each of `rates` Mbit/s both ways (each byte crosses the
    caller's upload and the server's download, as a pipeline call crosses the driver's link and a server's), through
    p2p daemons and through plain TCP. Against the payload at the link's rate (2 x size x 8 / rate): what the way
    adds a call (TCP: its headers, and whatever the shaped queue costs it; p2p beyond TCP: the daemons), and the TCP
    retransmissions and timeouts both namespaces counted meanwhile."""
    script = [sys.executable, str(SCRIPT)]
    common = ["--floor-calls", str(calls), "--floor-gap-s", str(gap_s), "--floor-bytes", *map(str, sizes)]
    result: dict = {"calls": calls, "gap_s": gap_s, "rates": {}}
    with Lab(2, host_link=False) as lab:
        addresses = root / "floor-server.json"
        lab.run(1, [*script, "--floor-peer", "serve", lab.ip(1), str(addresses), *common], root / "floor-server.out")
        wait_lab_node(addresses.exists, lab, 1, "to start its echoes", root / "floor-server.out")
        for rate in rates:
            for index in range(2):
                lab.shape(index, Link(mbit=rate))
            before = [tcp_counters(lab.ns(i)) for i in range(2)]
            log = root / f"floor-call-{rate:g}.out"
            caller = lab.run(0, [*script, "--floor-peer", "call", lab.ip(0), str(addresses), *common], log)
            if caller.wait(timeout=1800) != 0:
                raise RuntimeError(f"the lab floor's caller failed at {rate:g} Mbit/s: {log.read_text()[-3000:]}")
            trouble = sum(((tcp_counters(lab.ns(i)) - before[i]) for i in range(2)), Counter())
            times = json.loads(log.read_text().strip().splitlines()[-1])
            rows = {}
            for size in sizes:
                payload_ms = 1000 * 2 * size * 8 / (rate * 1e6)
                row = {way: 1000 * statistics.median(t) for way, t in times[str(size)].items()}
                row.update(
                    payload_at_rate_ms=payload_ms,
                    tcp_beyond_payload_ms=row["tcp"] - payload_ms,
                    p2p_beyond_tcp_ms=row["p2p"] - row["tcp"],
                )
                rows[size] = row
                print(
                    f"lab floor {rate:g} Mbit/s {size:>9} B: payload at the rate {payload_ms:8.1f} ms, tcp "
                    f"{row['tcp']:8.1f} ms (+{row['tcp_beyond_payload_ms']:5.1f}), p2p {row['p2p']:8.1f} ms "
                    f"(+{row['p2p_beyond_tcp_ms']:5.1f} beyond tcp)",
                    flush=True,
                )
            print(f"lab floor {rate:g} Mbit/s: TCP trouble in both namespaces {dict(trouble) or 'none'}", flush=True)
            result["rates"][rate] = {"bytes": rows, "tcp_trouble": {k: trouble.get(k, 0) for k in TCP_TROUBLE}}
    return result
