"""--check-cost and --protobuf-cost: what checking a received tensor and parsing a protobuf message cost, no network."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import torch


def check_cost(sizes: list[int], repeats: int) -> dict:
    """What a stage server's check of one received tensor costs (node/pipeline/tensors.py `expect`: the bytes become a
    tensor and every value must be finite), against the torch check it replaced (`from_wire`, then
    `torch.isfinite(t).all()`), on one torch thread as a server runs. Float32 and bfloat16 tensors of each size in
    bytes, the two ways interleaved call by call; medians in ms. Both ways must agree on a tensor with a NaN."""
    from node.pipeline.tensors import FLOATS, TensorRefused, expect, from_wire, to_wire

    def torch_check(wire) -> bool:
        return bool(torch.isfinite(from_wire(wire)).all())

    def shipped_check(wire) -> bool:
        try:
            expect({"x": wire}, "x", FLOATS, tuple(wire.shape))
        except TensorRefused:
            return False
        return True

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rows: dict = {}
    try:
        for size in sizes:
            for dtype in (torch.float32, torch.bfloat16):
                values = torch.randn(size // (torch.finfo(dtype).bits // 8), dtype=dtype)
                wire = to_wire(values)
                spoiled = values.clone()
                spoiled[len(spoiled) // 2] = float("nan")
                if torch_check(to_wire(spoiled)) or shipped_check(to_wire(spoiled)) or not shipped_check(wire):
                    raise RuntimeError(f"the two checks disagree on a {dtype} tensor of {size} bytes")
                times: dict[str, list[float]] = {"torch": [], "shipped": []}
                for repeat in range(repeats + 1):  # the first of each way warms it up and is not counted
                    for way, check in (("torch", torch_check), ("shipped", shipped_check)):
                        started = time.perf_counter()
                        check(wire)
                        if repeat:
                            times[way].append(time.perf_counter() - started)
                row = {way: 1000 * statistics.median(t) for way, t in times.items()}
                row["torch_over_shipped"] = row["torch"] / row["shipped"]
                rows[f"{size} {str(dtype).removeprefix('torch.')}"] = row
                print(
                    f"{size:>9} B {str(dtype).removeprefix('torch.'):>8}: torch.isfinite {row['torch']:7.3f} ms, "
                    f"shipped (numpy) {row['shipped']:7.3f} ms, {row['torch_over_shipped']:5.1f}x",
                    flush=True,
                )
    finally:
        torch.set_num_threads(threads)
    return {"repeats": repeats, "threads": 1, "ms": rows}


PROTOBUF_PROBE = r"""
import json, os, sys, time
from node.transport.protobuf_shim import import_hivemind_isolated
import_hivemind_isolated()
from google.protobuf.internal import api_implementation
from hivemind.proto import dht_pb2, p2pd_pb2
repeats = int(sys.argv[1])
found = dht_pb2.FindResponse()  # a DHT node's answer to a get: 8 keys' values and their nearest peers
for _ in range(8):
    result = found.results.add(type=dht_pb2.FOUND_REGULAR, value=os.urandom(600), expiration_time=1e9)
    result.nearest_node_ids.extend(os.urandom(20) for _ in range(5))
    result.nearest_peer_ids.extend(os.urandom(38) for _ in range(5))
opening = p2pd_pb2.Request(type=p2pd_pb2.Request.STREAM_OPEN)  # what each pipeline call asks its p2p daemon
opening.streamOpen.peer = os.urandom(38)
opening.streamOpen.proto.append("swarm-node/v1/swarm/pipeline/0123456789abcdef/v1")
us = {}
for name, message in (("dht_find_response", found), ("stream_open_request", opening)):
    data = message.SerializeToString()
    started = time.perf_counter()
    for _ in range(repeats):
        parsed = type(message)()
        parsed.ParseFromString(data)
        if parsed.SerializeToString() != data:
            raise SystemExit(f"{name} did not round-trip")
    us[name] = {"bytes": len(data), "us": 1e6 * (time.perf_counter() - started) / repeats}
print(json.dumps({"implementation": api_implementation.Type(), "messages": us}))
"""


def protobuf_cost(repeats: int) -> dict:
    """What parsing and re-serializing a protobuf message costs in each implementation of google.protobuf (its C
    runtime, upb, the default; and pure Python), each in a fresh interpreter: a hivemind DHT answer and a p2p daemon
    stream-open request, the messages a stage server's event loop handles. upb calls malloc_trim(0) every 10,000 of
    its arena frees, which hands back the memory torch just freed (node/host_memory.py); pure Python does not, and
    costs this much more a message."""
    rows = {}
    for implementation in ("upb", "python"):
        env = {**os.environ, "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION": implementation}
        out = subprocess.run(
            [sys.executable, "-c", PROTOBUF_PROBE, str(repeats)],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            timeout=600,
        )
        row = json.loads(out.stdout.strip().splitlines()[-1])
        if row["implementation"] != implementation:
            raise RuntimeError(f"asked for protobuf's {implementation} implementation, got {row['implementation']}")
        rows[implementation] = row["messages"]
    for name, upb in rows["upb"].items():
        python = rows["python"][name]
        print(
            f"{name} ({upb['bytes']} B): upb {upb['us']:.1f} us, pure Python {python['us']:.1f} us a message, "
            f"{python['us'] / upb['us']:.0f}x",
            flush=True,
        )
    return {
        "repeats": repeats,
        "us_per_message": rows,
        "python_over_upb": {name: rows["python"][name]["us"] / upb["us"] for name, upb in rows["upb"].items()},
    }
