"""Memory of swarm nodes over a long run: RSS at 5 minutes vs at the end (target: within 10 %).

Starts a real 2-node swarm (`swarm-node join` processes on 127.0.0.1, default model, 4 local
+ 4 external questions, gossipsub and DHT records, one torch thread each), samples the
resident memory of each node process and of its p2p daemon every --sample-s seconds from
/proc, and reports, per node, RSS (node + p2pd) at 5 minutes and at the end, and their
ratio. The nodes are stopped (SIGINT, then SIGKILL by their own process groups) at the end.

    .venv/bin/python benchmarks/node_memory.py --minutes 60
Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def rss_bytes(pid: int) -> int:
    """Resident memory of `pid` and its children (the p2p daemon), from /proc."""
    total = 0
    pids = [pid]
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        pids += [int(c) for c in children]
    except OSError:
        pass
    for p in pids:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            continue
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--sample-s", type=float, default=30.0)
    args = parser.parse_args()
    # SIGTERM ends the sampling early but still reports what was measured so far.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    scratch = Path(tempfile.mkdtemp(prefix="node-memory-"))
    # `join`'s preset already means the DHT transport with 4 external questions; said here too so
    # that the benchmark measures that configuration whatever the preset becomes.
    common = [
        "--set",
        "torch_threads=1",
        "--set",
        "swarm.transport=dht",
        "--set",
        "swarm.external_questions=4",
        "--set",
        'swarm.host_maddrs=["/ip4/127.0.0.1/tcp/0"]',
        "--set",
        "swarm.swarm_id=memory-bench",
        "--set",
        "checkpoint_every=10",
    ]
    exe = [sys.executable, "-m", "node.cli"]
    procs = []
    try:
        first = subprocess.Popen(
            exe + ["join", "--state-dir", str(scratch / "a"), *common],
            stdout=open(scratch / "a.out", "w"),
            stderr=subprocess.STDOUT,
            cwd=REPO,
            start_new_session=True,
        )
        procs.append(first)
        addresses = scratch / "a" / "addresses.txt"
        for _ in range(600):
            if addresses.exists() and addresses.read_text().strip():
                break
            time.sleep(1)
        second = subprocess.Popen(
            exe
            + [
                "join",
                "--state-dir",
                str(scratch / "b"),
                "--initial-peers",
                *addresses.read_text().split()[:1],
                *common,
            ],
            stdout=open(scratch / "b.out", "w"),
            stderr=subprocess.STDOUT,
            cwd=REPO,
            start_new_session=True,
        )
        procs.append(second)
        started = time.monotonic()
        samples: dict[str, list[tuple[float, int]]] = {"a": [], "b": []}
        stopped_early = None
        try:
            while time.monotonic() - started < args.minutes * 60:
                time.sleep(args.sample_s)
                elapsed = time.monotonic() - started
                for name, proc in zip("ab", procs):
                    if proc.poll() is not None:
                        raise SystemExit(f"node {name} exited with {proc.returncode}; see {scratch / (name + '.out')}")
                    samples[name].append((elapsed, rss_bytes(proc.pid)))
                print(
                    f"{elapsed / 60:5.1f} min: " + ", ".join(f"{n} {samples[n][-1][1] / 2**20:.0f} MiB" for n in "ab"),
                    flush=True,
                )
        except KeyboardInterrupt:
            stopped_early = round((time.monotonic() - started) / 60, 2)
            print(f"stopped early after {stopped_early} min; reporting the samples taken so far", flush=True)
        if not samples["a"]:
            raise SystemExit("no sample was taken")
        result = {}
        for name in "ab":
            at5 = (
                next(rss for t, rss in samples[name] if t >= 300)
                if any(t >= 300 for t, _ in samples[name])
                else samples[name][0][1]
            )
            end = samples[name][-1][1]
            rounds = sum(1 for _ in open(scratch / name / "metrics.jsonl"))
            result[name] = {
                "rss_5min_mib": round(at5 / 2**20, 1),
                "rss_end_mib": round(end / 2**20, 1),
                "ratio": round(end / at5, 4),
                "rounds": rounds,
            }
            print(
                f"node {name}: RSS at 5 min {at5 / 2**20:.0f} MiB, at {samples[name][-1][0] / 60:.0f} min "
                f"{end / 2**20:.0f} MiB (x{end / at5:.3f}), {rounds} rounds"
            )
        minutes = stopped_early if stopped_early is not None else args.minutes
        print(
            json.dumps(
                {
                    "benchmark": "node_memory",
                    "minutes": minutes,
                    "nodes": result,
                    "max_ratio": max(r["ratio"] for r in result.values()),
                }
            )
        )
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGINT)
        for proc in procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


if __name__ == "__main__":
    main()
