"""Does handing freed memory back to the system matter for a training node? Three allocator arms side by side.

Each arm runs the same workload in a process of its own (so that no arm inherits another's heap): a node on the default
model, `--rounds` rounds of its own rollouts and GRPO step, and every round `--peers` peers' batches decoded, checked,
re-scored and trained on through the real in-process transport (each peer's batch is the node's own, signed again by a
throwaway identity: the same sizes, fresh bytes to decode every round). The arms:
- `defaults`: glibc's malloc as it comes (the environment names GLIBC_TUNABLES, so `Node.load` leaves it);
- `hand_back`: what a training node ships with, `hand_back_freed_memory` (node/host_memory.py): blocks beyond 256 KiB
  are mappings of their own, handed back when freed;
- `trim`: glibc's defaults, and `malloc_trim(0)` after every round (which hands back every free page of every arena).
Reported per arm: the resident memory after `--warmup` rounds and at the end, their ratio (the soak's target: at most
1.10), the peak (VmHWM), and the wall and CPU seconds a round takes after the warm-up (the trim's own included, and
apart). With `--repeats` the arms run in turn, a, b, c, a, b, c, so that a change of the machine's load is spread
over all of them; each figure is then listed per repeat.

    .venv/bin/python benchmarks/freed_memory.py --rounds 300 --warmup 30 --peers 8 --repeats 2 \
        --results benchmarks/results/freed_memory.jsonl
Ends with one JSON line (appended to --results when given).
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

ARMS = ("defaults", "hand_back", "trim")
# What every arm's node runs: the default model, a round's peers' questions taken in, nothing but the round's work.
NODE_SETTINGS = [
    "torch_threads=1",
    "swarm.transport=dht",  # an identity and peers' groups; the transport itself is replaced by the in-process one
    "swarm.external_questions=4",
    "eval_every=0",
    "checkpoint_every=1000000",  # the disk's writes are not the allocator's question
]


def resident_bytes() -> int:
    """This process's resident memory now (/proc/self/statm: pages)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_resident_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


async def run_arm(arm: str, rounds: int, warmup: int, peers: int) -> dict:
    """One arm's workload in this process; returns its figures."""
    import transformers

    from node.config import load_config
    from node.host_memory import hand_back_freed_memory
    from node.loop import Node
    from node.transport.inprocess import InProcessExchange, InProcessTransport
    from node.transport.records import RecordWriter
    from protocol import NodeIdentity, decode_message

    transformers.utils.logging.set_verbosity_error()
    libc = ctypes.CDLL(None)
    with tempfile.TemporaryDirectory() as scratch:
        config = load_config(None, NODE_SETTINGS, state_dir=scratch)
        node = Node(config)
        node.load(fresh=True, progress=False)  # hand_back: applies the shipped setting; the others: left as set
        applied = hand_back_freed_memory()  # again, to learn whether load did (the others' environment refuses it)
        exchange = InProcessExchange()
        node.transport = InProcessTransport(exchange, config, node.identity, node.stats, node.fingerprint)
        writers = [RecordWriter(NodeIdentity.generate(), config.swarm.swarm_id) for _ in range(peers)]
        seconds, cpu_seconds, trim_seconds, resident = [], [], [], []
        for _ in range(rounds):
            started, cpu_started = time.perf_counter(), time.process_time()
            await node.run_round()
            own = exchange.latest.get(node.identity.node_id)
            if own is not None:  # next round's peers' batches: the node's own, signed again by each peer
                batch = decode_message(own, swarm_id=config.swarm.swarm_id).message
                for writer in writers:
                    exchange.latest[writer.identity.node_id] = writer.sign(batch).data
            trimmed = time.perf_counter()
            if arm == "trim":
                libc.malloc_trim(0)
            finished = time.perf_counter()
            seconds.append(finished - started)
            cpu_seconds.append(time.process_time() - cpu_started)
            trim_seconds.append(finished - trimmed)
            resident.append(resident_bytes())
        after = seconds[warmup:]
        return {
            "hand_back_applied": applied,
            "rss_warm_mib": round(resident[warmup - 1] / 2**20, 1),
            "rss_end_mib": round(resident[-1] / 2**20, 1),
            "ratio": round(resident[-1] / resident[warmup - 1], 4),
            "rss_max_mib": round(max(resident) / 2**20, 1),
            "peak_mib": round(peak_resident_bytes() / 2**20, 1),
            "round_s": round(sum(after) / len(after), 3),
            "round_cpu_s": round(sum(cpu_seconds[warmup:]) / len(after), 3),
            "trim_s": round(sum(trim_seconds[warmup:]) / len(after), 4),
            "rounds": rounds,
            "peer_groups_received": sum(c.questions_received for c in node.stats.peers.values()),
        }


def arm_environment(arm: str) -> dict[str, str]:
    env = dict(os.environ)
    for name in ("MALLOC_ARENA_MAX", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES"):
        env.pop(name, None)
    if arm != "hand_back":
        env["GLIBC_TUNABLES"] = ""  # no tunable set: glibc's defaults, and node/host_memory.py leaves the allocator
    return env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="rounds before the first RSS figure")
    parser.add_argument("--peers", type=int, default=4, help="peers whose batch is decoded every round")
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    parser.add_argument("--repeats", type=int, default=1, help="runs of every arm, in turn")
    parser.add_argument("--results", type=Path, help="append the JSON line to this file")
    parser.add_argument("--worker", choices=ARMS, help=argparse.SUPPRESS)  # one arm, in this process
    args = parser.parse_args()
    if not 1 <= args.warmup < args.rounds:
        parser.error("--warmup must be at least 1 and below --rounds")
    if args.worker:
        print(json.dumps(asyncio.run(run_arm(args.worker, args.rounds, args.warmup, args.peers))))
        return
    worker_args = ["--rounds", str(args.rounds), "--warmup", str(args.warmup), "--peers", str(args.peers)]
    figures: dict[str, list[dict]] = {arm: [] for arm in args.arms}
    for repeat in range(args.repeats):
        for arm in args.arms:
            command = [sys.executable, __file__, "--worker", arm, *worker_args]
            done = subprocess.run(command, env=arm_environment(arm), cwd=REPO, capture_output=True, text=True)
            if done.returncode != 0:
                raise SystemExit(f"arm {arm} failed ({done.returncode}):\n{done.stderr[-4000:]}")
            f = json.loads(done.stdout.strip().splitlines()[-1])
            figures[arm].append(f)
            print(
                f"{arm:>9} #{repeat + 1}: RSS after {args.warmup} rounds {f['rss_warm_mib']:.0f} MiB, after "
                f"{args.rounds} {f['rss_end_mib']:.0f} MiB (x{f['ratio']:.3f}), peak {f['peak_mib']:.0f} MiB; "
                f"a round {f['round_s']:.3f} s, {f['round_cpu_s']:.3f} CPU s (trim {f['trim_s'] * 1000:.1f} ms)",
                flush=True,
            )
    line = {
        "benchmark": "freed_memory",
        "date": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()),
        "rounds": args.rounds,
        "warmup": args.warmup,
        "peers": args.peers,
        "arms": figures,
        "load_average": os.getloadavg(),
    }
    from benchmarks.common import print_result_line

    print_result_line(line, args.results)


if __name__ == "__main__":
    main()
