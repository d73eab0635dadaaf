"""Memory of nodes over a long run: RSS at 5 minutes vs at the end (target: within 10 %), and its peak.

Default: a real 2-node swarm (`swarm-node join` processes on 127.0.0.1, default model, 4 local
+ 4 external questions, gossipsub and DHT records, one torch thread each). --isolated CONFIG: one
`swarm-node train --config CONFIG` node alone (configs/smollm2.yaml: SmolLM2-135M-Instruct, whose
float32 weights, gradients and AdamW state are 2.15 GB of it; target at most 3.5 GiB). Samples the
resident memory of each node process and of its p2p daemon every --sample-s seconds from /proc,
and reports, per node, RSS (node + p2pd) at 5 minutes and at the end, their ratio, the largest
sample and the node process's own peak (VmHWM, the kernel's high-water mark, which no sampling
interval misses). The nodes are stopped (SIGINT, then SIGKILL by their own process groups) at the end.

    .venv/bin/python benchmarks/node_memory.py --minutes 60
    .venv/bin/python benchmarks/node_memory.py --minutes 60 --isolated configs/smollm2.yaml \\
        --results benchmarks/results/node_memory.jsonl
Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import print_result_line  # noqa: E402

EXE = [sys.executable, "-m", "node.cli"]
# `join`'s preset already means the DHT transport with 4 external questions; said here too so
# that the benchmark measures that configuration whatever the preset becomes.
SWARM_SETTINGS = [
    "torch_threads=1",
    "swarm.transport=dht",
    "swarm.external_questions=4",
    'swarm.host_maddrs=["/ip4/127.0.0.1/tcp/0"]',
    "swarm.swarm_id=memory-bench",
    "checkpoint_every=10",
]


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


def peak_rss_bytes(pid: int) -> int:
    """The kernel's high-water mark of `pid`'s own resident memory (VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def start(command: list[str], scratch: Path, name: str) -> subprocess.Popen:
    return subprocess.Popen(
        EXE + command,
        stdout=open(scratch / f"{name}.out", "w"),
        stderr=subprocess.STDOUT,
        cwd=REPO,
        start_new_session=True,
    )


def settings(values: list[str]) -> list[str]:
    return [arg for value in values for arg in ("--set", value)]


def start_swarm(scratch: Path) -> list[subprocess.Popen]:
    """Two `join` nodes on the loopback, the second given the first's address."""
    first = start(["join", "--state-dir", str(scratch / "a"), *settings(SWARM_SETTINGS)], scratch, "a")
    addresses = scratch / "a" / "addresses.txt"
    for _ in range(600):
        if addresses.exists() and addresses.read_text().strip():
            break
        time.sleep(1)
    initial = ["--initial-peers", *addresses.read_text().split()[:1]]
    second = start(["join", "--state-dir", str(scratch / "b"), *initial, *settings(SWARM_SETTINGS)], scratch, "b")
    return [first, second]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--sample-s", type=float, default=30.0)
    parser.add_argument("--isolated", metavar="CONFIG", help="one `train` node on this config instead of a swarm")
    parser.add_argument("--set", action="append", default=[], help="config overrides of the --isolated node")
    parser.add_argument("--results", type=Path, default=None, help="also append the JSON line here")
    args = parser.parse_args()
    # SIGTERM ends the sampling early but still reports what was measured so far.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    scratch = Path(tempfile.mkdtemp(prefix="node-memory-"))
    procs: list[subprocess.Popen] = []
    names = "a" if args.isolated else "ab"
    try:
        if args.isolated:
            isolated = ["--config", args.isolated, *settings(["checkpoint_every=10", *args.set])]
            procs.append(start(["train", "--state-dir", str(scratch / "a"), *isolated], scratch, "a"))
        else:
            procs += start_swarm(scratch)
        started = time.monotonic()
        samples: dict[str, list[tuple[float, int]]] = {name: [] for name in names}
        peaks: dict[str, int] = {}
        stopped_early = None
        try:
            while time.monotonic() - started < args.minutes * 60:
                time.sleep(args.sample_s)
                elapsed = time.monotonic() - started
                for name, proc in zip(names, procs):
                    if proc.poll() is not None:
                        raise SystemExit(f"node {name} exited with {proc.returncode}; see {scratch / (name + '.out')}")
                    samples[name].append((elapsed, rss_bytes(proc.pid)))
                    peaks[name] = peak_rss_bytes(proc.pid)
                now = [f"{n} {samples[n][-1][1] / 2**20:.0f} MiB (peak {peaks[n] / 2**20:.0f})" for n in names]
                print(f"{elapsed / 60:5.1f} min: " + ", ".join(now), flush=True)
        except KeyboardInterrupt:
            stopped_early = round((time.monotonic() - started) / 60, 2)
            print(f"stopped early after {stopped_early} min; reporting the samples taken so far", flush=True)
        if not samples["a"]:
            raise SystemExit("no sample was taken")
        result = {}
        for name in names:
            at5 = next((rss for t, rss in samples[name] if t >= 300), samples[name][0][1])
            end = samples[name][-1][1]
            metrics = scratch / name / "metrics.jsonl"
            rounds = sum(1 for _ in open(metrics)) if metrics.exists() else 0
            result[name] = {
                "rss_5min_mib": round(at5 / 2**20, 1),
                "rss_end_mib": round(end / 2**20, 1),
                "ratio": round(end / at5, 4),
                "rss_max_sampled_mib": round(max(rss for _, rss in samples[name]) / 2**20, 1),
                "peak_mib": round(peaks[name] / 2**20, 1),
                "rounds": rounds,
            }
            print(
                f"node {name}: RSS at 5 min {at5 / 2**20:.0f} MiB, at {samples[name][-1][0] / 60:.0f} min "
                f"{end / 2**20:.0f} MiB (x{end / at5:.3f}), peak {peaks[name] / 2**20:.0f} MiB, {rounds} rounds"
            )
        line = {
            "benchmark": "node_memory",
            "date": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()),
            "isolated": args.isolated,
            "overrides": args.set,
            "minutes": stopped_early if stopped_early is not None else args.minutes,
            "nodes": result,
            "max_ratio": max(r["ratio"] for r in result.values()),
            "max_peak_mib": max(r["peak_mib"] for r in result.values()),
            "load_average": os.getloadavg(),
        }
        print_result_line(line, args.results)
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
