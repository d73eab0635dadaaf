"""The campaign: which runs a configuration still lacks, launched one after the other or side by side (each in a
process of its own, in a network namespace of its own with per-host uplinks), their rows kept in --results under
the configuration's key."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from benchmarks.common import REPO, append_keyed_row, read_keyed_rows
from benchmarks.host_uplinks import RunNamespace
from benchmarks.recovery.bench import LoadHold, run
from benchmarks.recovery.report import print_report, report
from benchmarks.recovery.runs import model_shape, pretrain, uplink_per_host

RESULTS = REPO / "benchmarks" / "results" / "stage_recovery.jsonl"
SCRIPT = REPO / "benchmarks" / "stage_recovery.py"  # what a run side by side runs: `--one SEED RATE STRATEGY`
HOLD_POLL_S = 2.0  # --keep-load: how often the parent looks whether every run has reached its target or ended
CHILD_GRACE_S = 180.0  # a side-by-side run stops itself at --run-timeout-s; this long after, it is stopped from outside


def launch(args, runs: list[tuple[int, float, str]]) -> None:
    """The runs, each (seed, rate, strategy): with --side-by-side all at once, each in its own process (they share
    the machine's load); else one after the other, in this process, or in processes of their own where each must
    be in a network namespace of its own (per-host uplinks)."""
    if args.side_by_side:
        run_children(args, runs)
    elif uplink_per_host(args):
        for spec in runs:
            run_children(args, [spec])
    else:
        for seed, rate, strategy in runs:
            run_one(args, seed, rate, strategy)


def config_key(args) -> dict:
    """What makes two runs comparable: a report mixes only rows with the same key."""
    own_uplinks = bool(args.checkpoint_store_mbit) and args.checkpoint_uplinks != "shared"  # per stage or host
    background_uploads = bool(args.checkpoint_store_mbit) and args.checkpoint_uploads == "background"
    return {
        # rows from before --model and --failures existed have neither: absent means the default and the seeded rates
        **({"model": args.model} if args.model else {"shape": list(model_shape(args))}),
        **({"failures": list(args.failures)} if args.failures else {}),
        "max_steps": args.max_steps,
        "steps_per_hour": args.steps_per_hour,
        "checkpoint_every": str(args.checkpoint_every),
        **({"checkpoint_store_mbit": args.checkpoint_store_mbit} if args.checkpoint_store_mbit else {}),
        # only where it is not the first setting's: the rows from before it keep their key
        **({"checkpoint_uplinks": args.checkpoint_uplinks} if own_uplinks else {}),
        **({"checkpoint_uploads": args.checkpoint_uploads} if background_uploads else {}),
        **({"keep_load": True} if args.keep_load else {}),
        **({"pretrained_steps": args.pretrained_steps} if args.pretrained_steps else {}),
        **({"plain_baselines": True} if args.plain_baselines else {}),
        "target_fraction": args.target_fraction,
        "eval_every": args.eval_every,
        "micro_batch": args.micro_batch,
        "lr": args.lr,
        **({"settings": list(args.set)} if args.set else {}),
    }


def read_rows(path: Path, key: dict) -> list[dict]:
    """The rows of the configuration `key`, and the failure-free runs that serve it (baseline_key)."""
    return read_keyed_rows(
        path,
        key,
        serves=lambda row: row["strategy"] == "none" and baseline_key(row.get("key", {})) == baseline_key(key),
    )


def baseline_key(key: dict) -> dict:
    """A failure-free run does not checkpoint: it serves every checkpoint rule of otherwise the same settings. Where
    every host has an uplink of the rate (per-host), the rate shapes its steps too: it serves only that rate's. Its
    target loss does not depend on the load it ran at, so it serves runs with --keep-load or without (its normal step
    does, which is why young-own-steps prices against the run's own)."""
    kept = ("checkpoint_store_mbit", "checkpoint_uplinks") if key.get("checkpoint_uplinks") == "per-host" else ()
    dropped = (
        "checkpoint_every",
        "checkpoint_store_mbit",
        "checkpoint_uplinks",
        "checkpoint_uploads",
        "keep_load",
        "plain_baselines",  # the failure-free run, CheckFree's config, sets the target loss of both
    )
    return {name: value for name, value in key.items() if name in kept or name not in dropped}


def none_row(rows: list[dict], seed: int) -> dict | None:
    return next((r for r in rows if r["strategy"] == "none" and r["seed"] == seed and r.get("target")), None)


def run_one(args, seed: int, rate: float, strategy: str) -> None:
    """One run; its row is appended to --results as soon as it has its result (with --keep-load, before it keeps
    training). A failure-free run (`none`) sets its seed's target and normal step time, which the runs with failures
    read back from the file."""
    key = config_key(args)
    scratch = Path(tempfile.mkdtemp(prefix="stage-bench-"))
    hold = LoadHold(args.hold_dir) if args.hold_dir else None
    base = None
    if strategy != "none":
        base = none_row(read_rows(args.results, key), seed)
        if base is None:
            raise SystemExit(f"no failure-free run of seed {seed} in {args.results} for this configuration")

    def write_row(result: dict) -> None:
        if strategy == "none":
            target_step = int(args.max_steps * args.target_fraction)
            target = next((p["val_loss"] for p in result["curve"] if p["step"] >= target_step), None)
            reached = next((p for p in result["curve"] if target is not None and p["val_loss"] <= target), None)
            result.update(
                target=target,
                steps_to_target=reached and reached["executed"],
                wall_s_to_target=reached and reached["wall_s"],
            )
        else:
            result["target"] = base["target"]
        print(describe(append_keyed_row(args.results, key, result)), flush=True)

    target, step_s = (base["target"], base["normal_step_s"]) if base else (None, None)
    if args.pretrained_steps:
        pretrain(args, seed)  # a run started alone (--one); main has already made it otherwise
    asyncio.run(run(args, scratch, seed, strategy, rate if base else 0.0, target, step_s, write_row, hold))


def describe(row: dict) -> str:
    wall = row["wall_s_to_target"]
    text = (
        f"seed {row['seed']} rate {row['rate']:.2f} {row['strategy']:10s}: failures {row['failures']}, steps "
        f"{row['steps_to_target']}, wall {wall and round(wall, 1)}s, recovery "
        f"{[(r['methods'], round(r['seconds'], 2)) for r in row['recoveries']]}, "
        f"spike {[round(s, 3) for s in row['loss_spike']]}, load {[round(x, 1) for x in row['load_average']]}"
    )
    if row["strategy"] == "checkpoint":
        text += (
            f", checkpoint every {row['checkpoint_every']} steps, {len(row['checkpoint_saves_s'])} saves "
            f"{sum(row['checkpoint_saves_s']):.2f}s, loads {[round(x, 2) for x in row['checkpoint_loads_s']]}, "
            f"{row['checkpoint_bytes'] / 1e6:.1f} MB"
        )
    if row["strategy"] == "none":
        text += f", target val loss {row['target']}, normal step {row['normal_step_s']:.3f}s"
    text += f", calls retried or failed {row.get('retries')}, repeated {row.get('repeated_calls')}"
    return text + (", TIMED OUT" if row["timed_out"] else "")


def run_children(args, runs: list[tuple[int, float, str]]) -> None:
    """Each run in its own process, all at once, and wait for them all; a child still running well past
    --run-timeout-s (it stops itself at that limit) is stopped here."""
    passthrough = [a for a in sys.argv[1:] if a != "--side-by-side"]
    namespaces: list[RunNamespace] = []
    children = []
    hold = LoadHold(tempfile.mkdtemp(prefix="stage-hold-")) if args.keep_load else None
    try:
        for seed, rate, strategy in runs:
            command = [sys.executable, str(SCRIPT), *passthrough, "--one", str(seed), str(rate)]
            command.append(strategy)
            if hold is not None:
                command += ["--hold-dir", str(hold.folder)]
            if uplink_per_host(args):  # `ip netns exec` execs the run: the child is the run's process itself
                namespaces.append(RunNamespace())
                command = namespaces[-1].command(command)
            children.append(subprocess.Popen(command))
        deadline = time.monotonic() + args.run_timeout_s + CHILD_GRACE_S
        while hold is not None and not hold.release_when_settled(children, runs) and time.monotonic() < deadline:
            time.sleep(HOLD_POLL_S)
        for child, spec in zip(children, runs, strict=True):
            try:
                child.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                print(f"run {spec} still going {CHILD_GRACE_S:.0f}s past its limit: stopped, no row", flush=True)
                stop_child(child)
            if child.returncode != 0:
                print(f"run {spec} ended with exit status {child.returncode}", flush=True)
    finally:
        for child in children:
            if child.poll() is None:
                stop_child(child)
        for namespace in namespaces:
            namespace.close()
        if hold is not None:
            shutil.rmtree(hold.folder, ignore_errors=True)


def stop_child(child: subprocess.Popen) -> None:
    """Interrupt a run (its servers and p2p daemons shut down as after Ctrl-C); if it is still there 30 s later, kill
    it and what it started (its p2p daemons) by process id."""
    descendants = set(psutil.Process(child.pid).children(recursive=True))
    child.send_signal(signal.SIGINT)
    try:
        child.wait(timeout=30)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(psutil.NoSuchProcess):
            descendants |= set(psutil.Process(child.pid).children(recursive=True))
        child.kill()
        child.wait()
    for process in descendants:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()


def campaign(args) -> None:
    """The configuration's runs that --results lacks (the failure-free ones first, then rate by rate), and its report;
    with --report only the report, with --one only that run (a child of run_children)."""
    if args.report:
        print_report(report(read_rows(args.results, config_key(args)), args.rates, args.strategies))
        return
    if args.one:
        seed, rate, strategy = int(args.one[0]), float(args.one[1]), args.one[2]
        run_one(args, seed, rate, strategy)
        return
    seeds = [seed for seed in range(args.seeds) if args.only_seeds is None or seed in args.only_seeds]
    if args.pretrained_steps:  # before any run: runs side by side all read the same file
        for seed in seeds:
            pretrain(args, seed)
    baselines = [seed for seed in seeds if none_row(read_rows(args.results, config_key(args)), seed) is None]
    launch(args, [(seed, 0.0, "none") for seed in baselines])
    for rate in args.rates:  # in the order given: the one that matters most first, in case time runs out
        for seed in seeds:
            done = {(r["seed"], r["rate"], r["strategy"]) for r in read_rows(args.results, config_key(args))}
            launch(args, [(seed, rate, strategy) for strategy in args.strategies if (seed, rate, strategy) not in done])
    print_report(report(read_rows(args.results, config_key(args)), args.rates, args.strategies))
