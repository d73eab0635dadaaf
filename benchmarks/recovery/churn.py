"""Joiner churn (--churn, issue #24), the second benchmark: no spares; a random stage's only server killed before
each of --churn-failures seeded steps, a newcomer with `--stage auto` a random 0 to 2 announce TTLs later."""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.common import print_result_line
from benchmarks.recovery.bench import Bench, quiet_killed_daemons
from benchmarks.recovery.runs import STAGES


def churn_schedule(seed: int, steps: int, failures: int) -> tuple[list[int], random.Random]:
    """Steps before which a server is killed (spread over the run, seeded), and the rng that picks victims and joiner
    delays."""
    rng = random.Random(f"churn:{seed}")
    return sorted(rng.sample(range(4, steps), failures)), rng


async def run_churn(args, scratch: Path, seed: int, strategy: str) -> dict:
    """Joiner churn: a server is killed (as kill -9) before each scheduled step, and a newcomer with `--stage auto`
    joins a random delay later (0 to 2 announce TTLs: often before the dead server's announcement has aged out);
    no spares, no replicas. Stalls are measured from the later of the kill and the newcomer's arrival (when a server
    is available) to the end of the first step after it. `strategy` checkpoint: every --checkpoint-every steps every
    server saves its stage (timed); after a failure, once the newcomer serves, every stage loads the last checkpoint
    and the driver goes back to its step (those steps count as lost)."""
    asyncio.get_running_loop().set_exception_handler(quiet_killed_daemons)
    bench = Bench(args, scratch, seed, strategy)
    await bench.start()
    if strategy == "checkpoint":
        await bench.save_checkpoint()
    rolled_back, timed_out = 0, False
    kills, rng = churn_schedule(seed, args.churn_steps, args.churn_failures)
    ttl = bench.config.pipeline.announce_ttl_s
    joiners, stalls, methods, step_s, normal_step_s = [], [], [], [], []
    next_key = STAGES
    fired: set[int] = set()
    pending: dict | None = None  # the failure being recovered: kill time, the newcomer's arrival time

    async def join_later(delay: float, record: dict, key: int) -> None:
        await asyncio.sleep(delay)
        record["available"] = time.perf_counter()
        server = await bench.start_server("auto", key=key)
        await bench.wait_serving(key)
        record["server"] = server

    started = time.perf_counter()
    try:
        async with asyncio.timeout(args.run_timeout_s):
            while bench.driver.step < args.churn_steps:
                due = bench.driver.step + 1 in kills and bench.driver.step + 1 not in fired and pending is None
                if due:
                    fired.add(bench.driver.step + 1)  # once, even when a rollback replays its step
                victim_stage = rng.randrange(STAGES) if due else None
                victim = next(
                    (
                        k
                        for k, (server, _, _) in bench.servers.items()
                        if server.index == victim_stage and server.state == "serving"
                    ),
                    None,
                )
                if victim is not None:
                    await bench.kill(victim)
                    pending = {"stage": victim_stage, "killed": time.perf_counter(), "delay": rng.uniform(0, 2 * ttl)}
                    joiners.append(asyncio.create_task(join_later(pending["delay"], pending, next_key)))
                    next_key += 1
                    if strategy == "checkpoint":  # the stage comes back from the checkpoint, with every other stage
                        await joiners[-1]
                        rolled_back += bench.driver.step - bench.checkpoints.step
                        await bench.load_checkpoint()
                row = await bench.driver.train_step()
                done = time.perf_counter()
                step_s.append(row["step_s"])
                if pending is not None and "available" in pending:
                    stalls.append(
                        {
                            "stage": pending["stage"],
                            "joiner_delay_s": pending["delay"],
                            "stall_s": done - max(pending["killed"], pending["available"]),
                            "outage_s": done - pending["killed"],
                        }
                    )
                    pending = None
                elif pending is None:
                    normal_step_s.append(row["step_s"])
                if strategy == "checkpoint" and bench.driver.step % int(args.checkpoint_every) == 0:
                    await bench.save_checkpoint()
        final_val = await bench.driver.validation_loss()
    except (
        TimeoutError,
        RuntimeError,
    ) as exc:  # too slow, or a newcomer that never came up: said so, and counted as not finished
        final_val, timed_out = None, True
        print(f"seed {seed} churn {strategy}: run stopped: {type(exc).__name__}: {exc}", flush=True)
    finally:
        await asyncio.gather(*joiners, return_exceptions=True)
        for server, _, _ in bench.servers.values():
            event = (
                [json.loads(line) for line in (server.state_dir / "recoveries.jsonl").read_text().splitlines()]
                if (server.state_dir / "recoveries.jsonl").exists()
                else []
            )
            methods += [(e["method"], e["stage"], e["cause"]) for e in event if e["method"] != "initial"]
        await bench.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    median = statistics.median(normal_step_s) if normal_step_s else 0.0
    # Time lost to a failure: from the kill to the end of the first step after it, less a normal step (the same for
    # both strategies, whether the driver waited inside its step or the checkpoint was loaded before it).
    lost = (sum(max(0.0, s["outage_s"] - median) for s in stalls) / median if median else 0.0) + rolled_back
    executed = len(step_s)
    return {
        "seed": seed,
        "strategy": strategy,
        "steps": bench.driver.step,
        "executed": executed,
        "wall_s": time.perf_counter() - started,
        "failures": len(stalls),
        "announce_ttl_s": ttl,
        "longest_stall_s": max((s["stall_s"] for s in stalls), default=0.0),
        "stalls": stalls,
        "steps_lost_fraction": lost / (executed + lost - rolled_back) if executed else None,
        "rolled_back_steps": rolled_back,
        "val_loss": final_val,
        "checkpoint_io_s": bench.io_s,
        "timed_out": timed_out,
        "recoveries": methods,
    }


def churn(args) -> None:
    """--churn: every seed's checkfree and checkpoint runs one after the other, each printed as it ends, then the JSON
    line."""
    results = []
    for seed in range(args.seeds):
        for strategy in [s for s in args.strategies if s in ("checkfree", "checkpoint")]:
            result = asyncio.run(run_churn(args, Path(tempfile.mkdtemp(prefix="stage-churn-")), seed, strategy))
            results.append(result)
            print(
                f"seed {seed} churn {strategy:10s}: {result['steps']} steps ({result['executed']} executed) in "
                f"{result['wall_s']:.1f}s, "
                f"{result['failures']} failures, longest stall {result['longest_stall_s']:.2f}s (ttl "
                f"{result['announce_ttl_s']}s), "
                f"steps lost {result['steps_lost_fraction']:.3f}, val loss {result['val_loss']}, stalls "
                f"{[round(s['stall_s'], 2) for s in result['stalls']]}, "
                f"recoveries {result['recoveries']}",
                flush=True,
            )
    keys = (
        "seed",
        "strategy",
        "longest_stall_s",
        "announce_ttl_s",
        "steps_lost_fraction",
        "steps",
        "executed",
        "wall_s",
        "failures",
        "val_loss",
        "checkpoint_io_s",
        "timed_out",
    )
    print_result_line(
        {
            "benchmark": "stage_recovery",
            "seeds": args.seeds,
            "churn_steps": args.churn_steps,
            "churn_failures": args.churn_failures,
            "checkpoint_every": args.checkpoint_every,
            "joiner_churn": [{k: r[k] for k in keys} for r in results],
        }
    )
