"""What a step through S pipeline stages costs against the same model trained in one process (issue #37).

The language-model objective (node/pipeline/lm.py: `LMDriver`, the fixed offline corpus,
CheckFree+ swaps on odd micro-batches, as `swarm-node drive` runs it) at several model sizes,
each measured four ways side by side, in interleaved rounds so that the machine's load
weighs on every way alike:

- `one_process`: the whole model in this process, no stages, no network: the same
  micro-batches, the same loss, one AdamW step (what a user training it alone gets);
- `local S`: the model cut into S stages, each a real `StageHandler`/`StageBackend` in this
  process, called directly (no bytes on any wire): what the split itself costs, and each
  call's compute, to subtract from the same call over the network;
- `wire S`: S `swarm-node serve` processes on 127.0.0.1 (each its own process, p2p daemon and
  `torch_threads`), driven from this process by a real `PipelineRouter` over p2p streams.

Per way: step time, tokens/s (micro_batches x micro_batch_size x sequence_length per step);
per call of the wire ways, its round trip less the same call's time in the local way of the
same S (`overhead_ms`, by op: forward, backward, step); bytes of tensor payload per
micro-batch, each way (driver -> servers, servers -> driver: hop by hop, every hop goes through the
driver, see node/pipeline/driver.py; with `pipeline.direct_hops` a micro-batch is one chained forward, the collect
of its output and one chained backward, and a chained call has no `overhead_ms`: its round trip holds the hops after
it); and where each wire way's forward and backward calls spent their time
on their servers' own clocks (`server_ms_per_call`: the phases of node/pipeline/handler.py's CALL_PHASES, read
from every server's stage.json), beside the driver's time for the same calls; and what a call's torch work cost
its worker thread, on the servers and in the local way alike (`compute_cpu`, `compute_faults`: CPU ms and minor
page faults a call), so that a server's slower torch work is told apart from waiting. This process takes the
allocator setting its servers take (`pipeline.keep_freed_memory`, node/host_memory.py). Prints its figures and ends
with one JSON line.

Other modes, each instead of the above: `--variant NAME:KEY=VALUE,...` adds a `wire S NAME` way on
servers of its own; `--loss-check STEPS` trains the split in-process with each variant's settings and
compares the losses, with the whole model's in one process beside them (`--loss-check-one-process`: tied, as one
process trains it; its head untied; untied with each stage's gradient clipped apart, as the pipeline's are); `--lab
MBIT ...` runs every process in its own namespace of benchmarks/lab/ (root) on links shaped to each rate (with
`--lab-uploads MB`, each way again while every server's host uploads MB to a store over its own link: checkpoints in
the background beside the hidden states); `--recovery` kills servers and measures the stall per recovery method
(replica failover, a warm spare's checkfree and checkfree_plus);
`--transport-floor` echoes payloads of a call's sizes through two p2p daemons and through plain TCP, with no compute
(the wire's own cost per call, and the CPU it takes in this process and in the daemons; with `--lab`, across two
namespaces on shaped links: what a call costs beyond its payload at the link's rate); `--check-cost` times a server's
check of one received tensor of each of those sizes against the torch check it replaced;
`--protobuf-cost` times a DHT answer and a stream-open request in protobuf's upb and pure-Python implementations.

    .venv/bin/python benchmarks/pipeline_throughput.py                 # the three sizes, S = 2 and 4
    .venv/bin/python benchmarks/pipeline_throughput.py --tiny   # about a minute: tests/test_pipeline_throughput.py
    .venv/bin/python benchmarks/pipeline_throughput.py --sizes 27M --stages 4 \
        --variant bf16:pipeline.wire_dtype=bfloat16 --variant inflight2:pipeline.micro_batches_in_flight=2
    .venv/bin/python benchmarks/pipeline_throughput.py --sizes 5M --stages 4 --loss-check 200 \
        --loss-check-one-process tied untied untied-stage-clip --variant nocfp:pipeline.checkfree_plus=false
    .venv/bin/python benchmarks/pipeline_throughput.py --sizes 27M --recovery
    .venv/bin/python benchmarks/pipeline_throughput.py --transport-floor
    sudo .venv/bin/python benchmarks/pipeline_throughput.py --transport-floor --lab 100 20 --floor-calls 10
    .venv/bin/python benchmarks/pipeline_throughput.py --check-cost
    .venv/bin/python benchmarks/pipeline_throughput.py --protobuf-cost --floor-calls 3000
    .venv/bin/python benchmarks/pipeline_throughput.py --sizes 27M --stages 4 --set pipeline.keep_freed_memory=false
    sudo .venv/bin/python benchmarks/pipeline_throughput.py --sizes 27M --stages 4 --lab 100 20 \
        --variant "bf16+inflight2:pipeline.wire_dtype=bfloat16,driver:pipeline.micro_batches_in_flight=2"
    sudo .venv/bin/python benchmarks/pipeline_throughput.py --sizes 27M --stages 4 --lab 20 --lab-uploads 82 \
        --set pipeline.direct_hops=true --set pipeline.wire_dtype=bfloat16 \
        --set pipeline.micro_batches_in_flight=2
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

# run as a script, Python puts benchmarks/ on the path, not the repository: benchmarks.* is imported from there
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.throughput.harness import SIZES, TINY  # noqa: E402 - its package isolates hivemind before torch

import torch  # noqa: E402

from benchmarks.common import REPO, print_result_line  # noqa: E402
from benchmarks.throughput.costs import check_cost, protobuf_cost  # noqa: E402
from benchmarks.throughput.floor import FLOOR_BYTES, floor_peer, lab_floor, transport_floor  # noqa: E402
from benchmarks.throughput.lab_runs import lab_run  # noqa: E402
from benchmarks.throughput.loss_check import ONE_PROCESS_WAYS, loss_check  # noqa: E402
from benchmarks.throughput.recovery import print_stalls, recovery_run  # noqa: E402
from benchmarks.throughput.timing import measure_size, print_size  # noqa: E402
from node.config import load_config  # noqa: E402
from node.host_memory import keep_freed_memory  # noqa: E402


def parse_variant(text: str) -> tuple[str, list[str]]:
    name, _, settings = text.partition(":")
    return name, [setting for setting in settings.split(",") if setting]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), help=f"of {list(SIZES)}")
    parser.add_argument("--stages", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--steps", type=int, default=2, help="timed steps per way per round")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds over the ways")
    parser.add_argument("--tiny", action="store_true", help="a 4-layer, 32-wide model, 1 round of 1 step: a test")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override for all")
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME:KEY=VALUE[,KEY=VALUE]",
        help="another wire way with these settings, side by side (e.g. bf16:pipeline.wire_dtype=bfloat16)",
    )
    parser.add_argument("--variant-stages", nargs="+", type=int, default=[4], help="the S the variants run at")
    parser.add_argument("--one-process-threads", nargs="+", type=int, default=[1], help="torch threads, a way each")
    parser.add_argument(
        "--loss-check", type=int, default=0, metavar="STEPS", help="train local S=max(--stages) and each variant "
        "this many steps in process and compare their losses (no servers; instead of the timing)",
    )  # fmt: skip
    parser.add_argument(
        "--loss-check-one-process", nargs="*", default=["tied"], choices=list(ONE_PROCESS_WAYS), metavar="WAY",
        help=f"--loss-check: the whole model in one process too, each way of {list(ONE_PROCESS_WAYS)} (untied: the "
        "head its own copy of the embedding; stage-clip: each stage's gradient norm clipped apart, as the pipeline's)",
    )  # fmt: skip
    parser.add_argument(
        "--lab", nargs="+", type=float, metavar="MBIT", help="instead: the lab at these link rates (root), "
        "at S = max(--stages); a variant's `driver:KEY=VALUE` settings apply to the driver only",
    )  # fmt: skip
    parser.add_argument(
        "--lab-uploads", type=float, default=0.0, metavar="MB", help="--lab: every way again while each server's host "
        "uploads a file of MB to a store over its own link, again and again (checkpoints in the background)",
    )  # fmt: skip
    parser.add_argument(
        "--recovery", action="store_true", help="instead: stall per recovery method (loopback), as shipped and with "
        "each --variant's settings",
    )  # fmt: skip
    parser.add_argument("--recovery-repeats", type=int, default=1, help="--recovery: runs of each way, interleaved")
    parser.add_argument(
        "--transport-floor", action="store_true", help="instead: a framed echo of each --floor-bytes through two "
        "p2p daemons and through plain TCP on 127.0.0.1, no compute: what the wire alone costs a call; with --lab, "
        "between two lab namespaces on links shaped to each rate (root)",
    )  # fmt: skip
    parser.add_argument(
        "--check-cost", action="store_true", help="instead: what checking one received tensor of each --floor-bytes "
        "costs a stage server, the shipped check against torch.isfinite, no network",
    )  # fmt: skip
    parser.add_argument(
        "--protobuf-cost", action="store_true", help="instead: what parsing and re-serializing a DHT answer and a "
        "stream-open request costs in protobuf's upb and pure-Python implementations (--floor-calls times each)",
    )  # fmt: skip
    parser.add_argument("--floor-bytes", nargs="+", type=int, default=FLOOR_BYTES)
    parser.add_argument("--floor-calls", type=int, default=30, help="timed echoes per size and way")
    parser.add_argument(
        "--floor-gap-s", type=float, default=0.1, help="--transport-floor --lab: quiet before each echo, as a call "
        "follows a stage's compute",
    )  # fmt: skip
    # one end of the lab's floor, started by `lab_floor` inside a namespace: ROLE IP ADDRESSES_FILE
    parser.add_argument("--floor-peer", nargs=3, metavar=("ROLE", "IP", "ADDRESSES"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    # SIGTERM as Ctrl-C: the servers run in process groups of their own, which only our `finally` blocks end
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    sizes = TINY if args.tiny else {name: SIZES[name] for name in args.sizes}
    settings = list(args.set)
    variants = dict(parse_variant(v) for v in args.variant)
    if args.tiny:
        settings += ["pipeline.micro_batch_size=2", "pipeline.micro_batches=2", "pipeline.sequence_length=16"]
        args.steps, args.rounds = 1, 1
    # this process's torch work (one process, the local ways, the driver) under the allocator its servers run with
    kept = load_config(REPO / "configs" / "pipeline.yaml", settings).pipeline.keep_freed_memory and keep_freed_memory()
    started = time.time()
    summary: dict = {
        "benchmark": "pipeline_throughput",
        "date": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime(started)),
        "freed_memory_kept": kept,  # node/host_memory.py, in this process and (the same setting) its servers
    }
    if args.floor_peer:
        role, ip, addresses = args.floor_peer
        gap_s = args.floor_gap_s
        asyncio.run(floor_peer(role, ip, Path(addresses), args.floor_bytes, args.floor_calls, gap_s))
        return
    if args.lab and args.transport_floor:
        with tempfile.TemporaryDirectory(prefix="pipeline-throughput-lab-floor-") as scratch:
            floor = lab_floor(args.lab, args.floor_bytes, args.floor_calls, args.floor_gap_s, Path(scratch))
        summary.update(load_average=os.getloadavg(), lab_transport_floor=floor)
        print_result_line(summary)
        return
    if args.lab:
        with tempfile.TemporaryDirectory(prefix="pipeline-throughput-lab-") as scratch:
            runs = {
                name: lab_run(
                    name,
                    shape,
                    max(args.stages),
                    settings,
                    variants,
                    args.lab,
                    args.steps,
                    Path(scratch),
                    args.lab_uploads,
                )
                for name, shape in sizes.items()
            }
        summary.update(load_average=os.getloadavg(), settings=settings, stages=max(args.stages), lab=runs)
        print_result_line(summary)
        return
    if args.transport_floor:
        floor = asyncio.run(transport_floor(args.floor_bytes, args.floor_calls))
        summary.update(load_average=os.getloadavg(), transport_floor=floor)
        print_result_line(summary)
        return
    if args.protobuf_cost:
        summary.update(load_average=os.getloadavg(), protobuf_cost=protobuf_cost(args.floor_calls))
        print_result_line(summary)
        return
    if args.check_cost:
        summary.update(load_average=os.getloadavg(), check_cost=check_cost(args.floor_bytes, args.floor_calls))
        print_result_line(summary)
        return
    if args.recovery:
        ways = {"plain": settings} | {name: settings + extra for name, extra in variants.items()}
        events: dict[str, list[dict]] = {name: [] for name in sizes}
        with tempfile.TemporaryDirectory(prefix="pipeline-throughput-recovery-") as scratch:
            for repeat in range(args.recovery_repeats):  # the ways interleaved, so that they share the machine's load
                for name, shape in sizes.items():
                    for way, way_settings in ways.items():
                        run = asyncio.run(
                            recovery_run(f"{name}-{way}-{repeat}", shape, way_settings, args.steps, Path(scratch))
                        )
                        events[name] += [dict(event, way=way, repeat=repeat) for event in run]
        summary.update(
            load_average=os.getloadavg(),
            settings=settings,
            variants=variants,
            recovery_s_by_method=events,
            stall_s_by_way_and_method=print_stalls(events),
        )
        print_result_line(summary)
        return
    if args.loss_check:
        torch.set_num_threads(1)
        checks = [
            loss_check(
                name, shape, max(args.stages), settings, variants, args.loss_check, tuple(args.loss_check_one_process)
            )
            for name, shape in sizes.items()
        ]
        for check in checks:
            print(check)
        summary.update(load_average=os.getloadavg(), settings=settings, loss_check=checks)
        print_result_line(summary)
        return
    results = {}
    with tempfile.TemporaryDirectory(prefix="pipeline-throughput-") as scratch:
        for name, shape in sizes.items():
            results[name] = asyncio.run(
                measure_size(
                    name,
                    shape,
                    args.stages,
                    settings,
                    variants,
                    [s for s in args.variant_stages if s in args.stages] if variants else [],
                    args.one_process_threads,
                    args.steps,
                    args.rounds,
                    Path(scratch),
                )
            )
            print_size(name, results[name])
    summary.update(load_average=os.getloadavg(), settings=settings, steps=args.steps, rounds=args.rounds, sizes=results)
    print_result_line(summary)


if __name__ == "__main__":
    main()
