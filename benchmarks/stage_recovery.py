"""Recovering lost pipeline stages: CheckFree(+) vs checkpoint-restart vs random re-initialisation.

A 4-stage pipeline of the default architecture (8 decoder layers, 2 per stage) trains
with the language-model loss on the fixed offline corpus. Every stage server is a real
`StageServer` on its own DHT node and p2p daemon, the driver a real `LMDriver` routing
over p2p streams — all in this one process (one asyncio loop), so that failures can be
injected at exact steps: a failure kills the server's p2p daemon (its peers see refused
connections, as after kill -9), stops its tasks and drops its state. A fresh server on a
fresh DHT node then takes the stage over (a warm spare: its start is counted in the
recovery time). Strategies, same seeds and the same failure schedule for each:

- none:        no failures (sets the target validation loss);
- checkfree:   the new server rebuilds the stage from its neighbours (CheckFree for
               stages 1-2, CheckFree+ for stages 0 and 3, see node/pipeline/recovery.py);
- checkpoint:  every --checkpoint-every steps every server saves its stage and optimizer
               (torch.save + fsync, timed); after a failure every stage, the new one too,
               loads the last checkpoint (timed) and the driver goes back to its step;
- random:      the new server initialises the stage randomly (fresh optimizer).

Failure schedule: each stage fails independently with probability rate / steps_per_hour
at each step (the paper's 5 %, 10 %, 16 % per stage per hour, with an "hour" scaled to
--steps-per-hour steps), drawn from the seed alone. The target is the validation loss the
failure-free run of the same seed reaches at --target-fraction of its steps. Reported per
strategy and rate (mean over seeds): steps executed and wall-clock seconds to the target,
recovery seconds (failure -> first step after), and the loss spike (the training loss of
the first step after a failure minus that of the step before it). Unlike the paper's
simulation (checkpoint_simulation.py replays a failure-free run and does not charge
checkpoint I/O), checkpoint save and load times are measured and charged here.

Churn mode (--churn, issue #24): no spares; before each of --churn-failures seeded steps a
random stage's only server is killed, and a newcomer joins with `--stage auto` a random 0 to
2 announce TTLs later, so that it often arrives while the dead server's announcement is still
readable. Reported per seed (`joiner_churn`): the longest stall (from when a server is
available, i.e. the later of the kill and the newcomer's arrival, to the end of the first step
after it), the announce TTL, the fraction of steps lost (from each kill to the end of the first
step after it, less a normal step, counted in normal steps, plus the steps a checkpoint rollback
replays, over all step slots), and the validation loss after the run. CheckFree and checkpoint-restart (the stage's
newcomer, then every stage, loads
the last checkpoint) on the same schedule.

    .venv/bin/python benchmarks/stage_recovery.py --seeds 3
    .venv/bin/python benchmarks/stage_recovery.py --churn --seeds 3
Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from node.transport.protobuf_shim import import_hivemind_isolated  # noqa: E402

import_hivemind_isolated()

import torch  # noqa: E402

from node.config import load_config  # noqa: E402
from node.files import fsync_dir  # noqa: E402
from node.model import ensure_default_model, load_policy, model_fingerprint  # noqa: E402
from node.pipeline.corpus import training_corpus, validation_corpus  # noqa: E402
from node.pipeline.driver import PipelineRouter  # noqa: E402
from node.pipeline.lm import LMDriver  # noqa: E402
from node.pipeline.server import StageServer  # noqa: E402
from node.pipeline.stagemap import LostReporter  # noqa: E402
from node.pipeline.stages import expected_fingerprints, pipeline_limits  # noqa: E402
from node.state import StateStore  # noqa: E402
from node.transport.joining import shutdown_dht  # noqa: E402
from node.transport.session import SwarmSession  # noqa: E402
from protocol import NodeIdentity  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
STAGES = 4


def failure_schedule(seed: int, rate: float, steps: int, steps_per_hour: int) -> dict[int, list[int]]:
    """{step: [stages that fail before it]}; depends on the seed and rate only."""
    rng = random.Random(f"failures:{seed}:{rate}")
    p = rate / steps_per_hour
    schedule: dict[int, list[int]] = {}
    for step in range(2, steps + 1):
        failed = [stage for stage in range(STAGES) if rng.random() < p]
        if failed:
            # one stage at a time: two neighbours lost together would need the paper's multi-failure rules
            schedule[step] = failed[:1]
    return schedule


class Bench:
    def __init__(self, args, scratch: Path, seed: int, strategy: str) -> None:
        self.args, self.scratch, self.seed, self.strategy = args, scratch, seed, strategy
        overrides = [
            f"model.default.hidden_size={args.hidden}",
            "model.default.num_layers=8",
            f"model.default.num_heads={max(2, args.hidden // 32)}",
            f"model.default.intermediate_size={args.hidden * 2}",
            "model.default.max_position_embeddings=128",
            "model.default.warmup_steps=0",
            f"model.default.seed={seed}",
            'swarm.host_maddrs=["/ip4/127.0.0.1/tcp/0"]',
            "swarm.swarm_id=stage-bench",
            f"pipeline.num_stages={STAGES}",
            f"pipeline.micro_batch_size={args.micro_batch}",
            "pipeline.micro_batches=2",
            "pipeline.sequence_length=64",
            "pipeline.corpus_sequences=2048",
            "pipeline.validation_sequences=32",
            "pipeline.eval_every=0",
            "pipeline.announce_interval_s=0.5",
            "pipeline.announce_ttl_s=3",
            "pipeline.avoid_s=5",
            "pipeline.call_timeout_s=20",
            f"pipeline.lr={args.lr}",
            f"pipeline.recovery={'random' if strategy == 'random' else 'checkfree'}",
            "pipeline.replica_sync_every=2",
            f"pipeline.corpus_seed={seed + 7}",
            "pipeline.rebalance_grace_s=3",
            "torch_threads=1",
        ]
        self.config = load_config(REPO / "configs" / "pipeline.yaml", overrides, state_dir=str(scratch / "driver"))
        self.dhts: list = []
        self.servers: dict[int, tuple[StageServer, asyncio.Task, object]] = {}
        self.checkpoint: dict | None = None
        self.dead: list[asyncio.Task] = []
        self.io_s = 0.0

    async def start(self) -> None:
        from hivemind.dht.node import DHTNode

        path = ensure_default_model(self.config, progress=False)
        self.model, self.tokenizer = load_policy(path)
        self.fingerprint = model_fingerprint(self.model, self.tokenizer)
        self.bootstrap = await DHTNode.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        self.addresses = [str(a) for a in await self.bootstrap.get_visible_maddrs()]
        for stage in range(STAGES):
            if self.args.churn:  # every server chooses its stage: each takes the next one left without a server
                await self.start_server("auto", key=stage)
                await self.wait_serving(stage)
            else:
                await self.start_server(stage)
        await self.wait_serving()
        limits = pipeline_limits(self.config, self.model.config, sum(p.numel() for p in self.model.parameters()))
        self.router = PipelineRouter(
            self.bootstrap,
            self.config,
            self.fingerprint,
            expected_fingerprints(self.config, self.model.config, self.fingerprint),
            limits,
            seed=self.seed,
            reporter=LostReporter(
                SwarmSession(self.config, self.bootstrap, "direct", NodeIdentity.generate()), self.fingerprint
            ),
        )
        shutil.rmtree(self.scratch / "driver", ignore_errors=True)
        self.driver = LMDriver(
            self.config,
            self.router,
            training_corpus(self.config, self.tokenizer),
            validation_corpus(self.config, self.tokenizer),
            StateStore(self.scratch / "driver"),
        )

    async def start_server(self, stage: int | str, key: int | None = None) -> StageServer:
        """A fresh server of `stage` (an index, or "auto": it chooses), kept under `key` (default: the stage)."""
        from hivemind.dht.node import DHTNode

        dht = await DHTNode.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=self.addresses)
        config = self.config.model_copy(update={"pipeline": self.config.pipeline.model_copy(update={"stage": stage})})
        session = SwarmSession(
            config, dht, "direct", NodeIdentity.generate(), self.scratch / f"server-{stage}-{time.time_ns()}"
        )
        server = StageServer(session, self.model, self.fingerprint)
        self.servers[stage if key is None else key] = (server, asyncio.create_task(server.run()), dht)
        return server

    async def wait_serving(self, stage: int | None = None) -> None:
        for _ in range(6000):
            servers = [self.servers[stage][0]] if stage is not None else [s for s, _, _ in self.servers.values()]
            if all(s.state == "serving" for s in servers):
                return
            await asyncio.sleep(0.01)
        raise RuntimeError("a stage server never started serving")

    async def kill(self, stage: int) -> None:
        server, task, dht = self.servers.pop(stage)
        process = getattr(dht.p2p, "_child", None)
        if process is not None and process.returncode is None:
            process.kill()  # as kill -9: its peers' calls now fail
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        # Its DHT node is cleaned up off the clock: a killed server does not wait for anything.
        self.dead.append(asyncio.create_task(shutdown_dht(dht, timeout=5)))

    def save_checkpoint(self) -> None:
        started = time.perf_counter()
        state = {"step": self.driver.step, "stages": {}}
        folder = self.scratch / "checkpoints"
        folder.mkdir(exist_ok=True)
        for (
            server,
            _,
            _,
        ) in self.servers.values():  # one file per stage (servers are kept by stage, or by arrival in churn mode)
            stage = server.index
            path = folder / f"stage-{stage}.pt"
            backend = server.backend
            torch.save(
                {
                    "stage": backend.stage.state_dict(),
                    "optimizer": backend.optimizer.state_dict(),
                    "step": backend.step,
                },
                path,
            )
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
            state["stages"][stage] = path
        fsync_dir(folder)
        self.checkpoint = state
        self.io_s += time.perf_counter() - started

    def load_checkpoint(self) -> None:
        started = time.perf_counter()
        for server, _, _ in self.servers.values():
            data = torch.load(self.checkpoint["stages"][server.index], weights_only=False)
            backend = server.backend
            backend.stage.load_state_dict(data["stage"])
            backend.lr_scale = 1.0
            backend.optimizer = backend.new_optimizer()
            backend.optimizer.load_state_dict(data["optimizer"])
            backend.step = data["step"]
        self.driver.step = self.checkpoint["step"]
        self.io_s += time.perf_counter() - started

    async def stop(self) -> None:
        await asyncio.gather(*self.dead, return_exceptions=True)
        for stage in list(self.servers):
            server, task, dht = self.servers.pop(stage)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await shutdown_dht(dht, timeout=5)
        await shutdown_dht(self.bootstrap, timeout=5)


def quiet_killed_daemons(loop, context) -> None:
    """hivemind's control-connection tasks of a killed p2p daemon end in ConnectionResetError: expected here, not
    news."""
    if isinstance(context.get("exception"), (ConnectionResetError, BrokenPipeError)):
        return
    loop.default_exception_handler(context)


async def run(args, scratch: Path, seed: int, strategy: str, rate: float, target: float | None) -> dict:
    asyncio.get_running_loop().set_exception_handler(quiet_killed_daemons)
    bench = Bench(args, scratch, seed, strategy)
    await bench.start()
    schedule = failure_schedule(seed, rate, args.max_steps, args.steps_per_hour) if strategy != "none" else {}
    curve, recoveries, spikes, normal_step_s = [], [], [], []
    started = time.perf_counter()
    timed_out = False
    try:
        async with asyncio.timeout(args.run_timeout_s):
            await train(bench, args, strategy, schedule, target, curve, recoveries, spikes, normal_step_s, started)
    except (
        TimeoutError,
        RuntimeError,
    ) as exc:  # too slow, or a stage server that never came up: a missed target, said so
        timed_out = True
        print(f"seed {seed} rate {rate:.2f} {strategy}: run stopped: {type(exc).__name__}: {exc}", flush=True)
    finally:
        await bench.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    reached = next((point for point in curve if target is not None and point["val_loss"] <= target), None)
    return {
        "seed": seed,
        "strategy": strategy,
        "rate": rate,
        "curve": curve,
        "failures": sum(len(v) for k, v in schedule.items() if k <= bench.driver.step),
        "steps_to_target": reached["executed"] if reached else None,
        "wall_s_to_target": reached["wall_s"] if reached else None,
        "recovery_s": recoveries,
        "loss_spike": spikes,
        "checkpoint_io_s": bench.io_s,
        "timed_out": timed_out,
    }


async def train(bench, args, strategy, schedule, target, curve, recoveries, spikes, normal_step_s, started) -> None:
    executed, fired, failed_at, last_loss = 0, set(), None, None
    if strategy == "checkpoint":
        bench.save_checkpoint()
    while executed < args.max_steps * 3:
        step = bench.driver.step + 1
        # each scheduled failure happens once, even when a rollback replays its step
        if step in schedule and step not in fired:
            fired.add(step)
            failed_at = time.perf_counter()
            for stage in schedule[step]:
                await bench.kill(stage)
                await bench.start_server(stage)
                await bench.wait_serving(stage)
            if strategy == "checkpoint":
                bench.load_checkpoint()
        row = await bench.driver.train_step()
        executed += 1
        if failed_at is not None:
            # Recovery: from the failure to the end of the first step after it, less what a normal step takes.
            recoveries.append(
                time.perf_counter() - failed_at - (statistics.median(normal_step_s) if normal_step_s else 0.0)
            )
            if last_loss is not None:
                spikes.append(row["loss"] - last_loss)
            failed_at = None
        else:
            normal_step_s.append(row["step_s"])
        last_loss = row["loss"]
        if strategy == "checkpoint" and bench.driver.step % args.checkpoint_every == 0:
            bench.save_checkpoint()
        if bench.driver.step % args.eval_every == 0:
            val = await bench.driver.validation_loss()
            curve.append(
                {
                    "step": bench.driver.step,
                    "executed": executed,
                    "wall_s": time.perf_counter() - started,
                    "val_loss": val,
                }
            )
            if target is not None and val <= target:
                break
        if bench.driver.step >= (args.max_steps if target is None else 2 * args.max_steps):
            break


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
        bench.save_checkpoint()
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
                        rolled_back += bench.driver.step - bench.checkpoint["step"]
                        bench.load_checkpoint()
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
                if strategy == "checkpoint" and bench.driver.step % args.checkpoint_every == 0:
                    bench.save_checkpoint()
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


def mean(values):
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--rates", type=float, nargs="+", default=[0.05, 0.10, 0.16])
    parser.add_argument("--strategies", nargs="+", default=["checkfree", "checkpoint", "random"])
    parser.add_argument(
        "--max-steps",
        type=int,
        default=200,
        help="steps of the failure-free run (runs with failures may take up to twice as many)",
    )
    parser.add_argument(
        "--steps-per-hour", type=int, default=25, help="how many steps stand for one hour of the paper's failure rates"
    )
    parser.add_argument("--checkpoint-every", type=int, default=25)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument(
        "--target-fraction",
        type=float,
        default=0.8,
        help="target = the failure-free run's validation loss at this fraction of --max-steps",
    )
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument(
        "--run-timeout-s",
        type=float,
        default=600.0,
        help="a run still short of the target after this long counts as missed",
    )
    parser.add_argument(
        "--churn",
        action="store_true",
        help="joiner churn instead: kills on a seeded schedule, newcomers with --stage auto, no spares",
    )
    parser.add_argument("--churn-steps", type=int, default=60, help="churn: driver steps per seed")
    parser.add_argument("--churn-failures", type=int, default=6, help="churn: servers killed per seed (one at a time)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    torch.set_num_threads(1)
    os.environ.setdefault("SWARM_NODE_CACHE", str(Path(tempfile.gettempdir()) / "swarm-node-bench-cache"))
    if args.churn:
        churn = []
        for seed in range(args.seeds):
            for strategy in [s for s in args.strategies if s in ("checkfree", "checkpoint")]:
                result = asyncio.run(run_churn(args, Path(tempfile.mkdtemp(prefix="stage-churn-")), seed, strategy))
                churn.append(result)
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
        print(
            json.dumps(
                {
                    "benchmark": "stage_recovery",
                    "seeds": args.seeds,
                    "churn_steps": args.churn_steps,
                    "churn_failures": args.churn_failures,
                    "checkpoint_every": args.checkpoint_every,
                    "joiner_churn": [{k: r[k] for k in keys} for r in churn],
                }
            )
        )
        return
    results = []
    for seed in range(args.seeds):
        base = asyncio.run(run(args, Path(tempfile.mkdtemp(prefix="stage-bench-")), seed, "none", 0.0, None))
        target_step = int(args.max_steps * args.target_fraction)
        target = next(p["val_loss"] for p in base["curve"] if p["step"] >= target_step)
        reached = next(p for p in base["curve"] if p["val_loss"] <= target)
        base.update(steps_to_target=reached["executed"], wall_s_to_target=reached["wall_s"], target=target)
        results.append(base)
        print(
            f"seed {seed} none: target val loss {target:.4f} at step {reached['step']}, {reached['wall_s']:.1f}s",
            flush=True,
        )
        for rate in args.rates:
            for strategy in args.strategies:
                result = asyncio.run(
                    run(args, Path(tempfile.mkdtemp(prefix="stage-bench-")), seed, strategy, rate, target)
                )
                result["target"] = target
                results.append(result)
                print(
                    f"seed {seed} rate {rate:.2f} {strategy:10s}: failures {result['failures']}, steps "
                    f"{result['steps_to_target']}, "
                    f"wall {result['wall_s_to_target'] and round(result['wall_s_to_target'], 1)}s, recovery "
                    f"{[round(r, 2) for r in result['recovery_s']]}, "
                    f"spike {[round(s, 3) for s in result['loss_spike']]}, checkpoint io "
                    f"{result['checkpoint_io_s']:.2f}s",
                    flush=True,
                )

    def table(key):
        out = {"none": mean(r[key] for r in results if r["strategy"] == "none")}
        for rate in args.rates:
            for strategy in args.strategies:
                out[f"{strategy}@{rate:.2f}"] = mean(
                    r[key] for r in results if r["strategy"] == strategy and r["rate"] == rate
                )
        return out

    steps, wall = table("steps_to_target"), table("wall_s_to_target")
    unreached = {
        f"{r['strategy']}@{r['rate']:.2f}": unreached for r in results if (unreached := r["steps_to_target"] is None)
    }
    print("\nmean over seeds            steps to target   wall s to target")
    for key in steps:
        print(
            f"{key:26s} {steps[key] if steps[key] is None else round(steps[key], 1)!s:>16} "
            f"{wall[key] if wall[key] is None else round(wall[key], 1)!s:>18}"
        )
    ratio = None
    if wall.get("checkfree@0.10") and wall.get("checkpoint@0.10"):
        ratio = wall["checkpoint@0.10"] / wall["checkfree@0.10"]
    recovery = {s: mean(x for r in results if r["strategy"] == s for x in r["recovery_s"]) for s in args.strategies}
    spike = {s: mean(x for r in results if r["strategy"] == s for x in r["loss_spike"]) for s in args.strategies}
    print(f"checkpoint / checkfree wall-clock to target at 10%: {ratio}")
    print(
        f"recovery seconds (failure -> first step after): {recovery}; loss spike: {spike}; runs that missed the "
        f"target: {sorted(unreached)}"
    )
    print(
        json.dumps(
            {
                "benchmark": "stage_recovery",
                "steps_to_target": steps,
                "wall_s_to_target": wall,
                "checkfree_vs_checkpoint_wall_ratio": ratio,
                "recovery_s": recovery,
                "loss_spike": spike,
                "seeds": args.seeds,
                "max_steps": args.max_steps,
                "steps_per_hour": args.steps_per_hour,
                "checkpoint_every": args.checkpoint_every,
                "missed_target": sorted(unreached),
            }
        )
    )


if __name__ == "__main__":
    main()
