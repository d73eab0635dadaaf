"""The run of one configuration: a 4-stage pipeline of real stage servers and a driver in this process, trained to
the target while stages fail on the schedule and come back by the strategy's method; its row of results."""

from __future__ import annotations

import asyncio
import json
import shutil
import statistics
import subprocess
import time
from pathlib import Path

import torch

from benchmarks.checkpoint_store import CheckpointStore, LoopbackStore
from benchmarks.host_uplinks import HostUplinks, port_of
from benchmarks.recovery.checkpoints import (
    PRICED_WITH_UPLOADS,
    Checkpoints,
    checkpoint_every,
    cost_with_uploads,
    own_normal_step,
)
from benchmarks.recovery.runs import STAGES, failure_schedule, pretrained_path, run_config, uplink_per_host
from node.aio import cancel_and_wait
from node.model import initial_policy_path, load_policy, model_fingerprint
from node.pipeline.corpus import training_corpus, validation_corpus
from node.pipeline.driver import PipelineRouter
from node.pipeline.lm import LMDriver
from node.pipeline.server import StageServer
from node.pipeline.stagemap import LostReporter
from node.pipeline.stages import expected_fingerprints, pipeline_limits
from node.state import StateStore
from node.transport.joining import shutdown_dht
from node.transport.session import SwarmSession
from protocol import NodeIdentity


class Bench:
    def __init__(self, args, scratch: Path, seed: int, strategy: str) -> None:
        self.args, self.scratch, self.seed, self.strategy = args, scratch, seed, strategy
        self.config = run_config(args, seed, strategy, scratch / "driver")
        self.dhts: list = []
        self.servers: dict[int, tuple[StageServer, asyncio.Task, object]] = {}
        self.dead: list[asyncio.Task] = []
        self.io_s = 0.0
        self.saves_s: list[float] = []  # each checkpoint of all stages, seconds
        self.save_cost_s = 0.0  # the last save, less any wait for the uploads before it (Young's rule prices this)
        self.loads_s: list[float] = []  # each restore of all stages, seconds
        self.last_bytes = 0
        per_host = uplink_per_host(args)
        # every host's uplink, on the loopback of this run's own namespace (main starts the run there)
        self.uplinks = HostUplinks(args.checkpoint_store_mbit) if per_host else None
        stores: list[CheckpointStore | LoopbackStore] = []
        if strategy == "checkpoint" and args.checkpoint_store_mbit:
            try:
                for index in range(STAGES if args.checkpoint_uplinks != "shared" else 1):
                    if per_host:  # a host of the run's namespace: its link is the loopback's shaping
                        stores.append(LoopbackStore(scratch, name=f"store-{index}"))
                        self.uplinks.add(f"store-{index}", sends_from=(stores[-1].port,))
                        # only stage `index`'s host uploads to this store: an upload goes over that host's uplink
                        self.uplinks.add(f"stage-{index}", sends_to=(stores[-1].port,))
                    else:
                        stores.append(CheckpointStore(args.checkpoint_store_mbit, scratch, name=f"store-{index}"))
            except BaseException:
                for store in stores:
                    store.close()
                raise
        background = args.checkpoint_uploads == "background"
        self.checkpoints = Checkpoints(scratch / "checkpoints", stores, background=background and bool(stores))

    async def start(self) -> None:
        from hivemind.dht.node import DHTNode

        for store in self.checkpoints.stores:
            await store.ready()
        # the default architecture built for this seed, or --model's pretrained weights (converted once, cached)
        self.model, self.tokenizer = load_policy(initial_policy_path(self.config))
        if self.args.pretrained_steps:  # pretrain() ran before this run started (main, or run_one)
            self.model.load_state_dict(torch.load(pretrained_path(self.args, self.seed), weights_only=True))
        self.fingerprint = model_fingerprint(self.model, self.tokenizer)
        self.bootstrap = await DHTNode.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        self.addresses = [str(a) for a in await self.bootstrap.get_visible_maddrs()]
        if self.uplinks is not None:  # the bootstrap node is the driver's: the driver's host
            self.uplinks.add("driver", sends_from=(port_of(self.addresses),))
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
        if self.uplinks is not None:  # a stage's host (a replacement: a new one behind a link of the same rate)
            self.uplinks.add(f"stage-{stage}", sends_from=(port_of(await dht.get_visible_maddrs()),))
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

    async def kill(self, stage: int) -> bool:
        """Kill a stage's server as kill -9 would. Returns whether that cut checkpoint uploads still going (its host's
        among them)."""
        server, task, dht = self.servers.pop(stage)
        process = getattr(dht.p2p, "_child", None)
        if process is not None and process.returncode is None:
            process.kill()  # as kill -9: its peers' calls now fail
        # cancel_and_wait: on Python 3.11 a cancel can be swallowed (node/aio.py), and a single one left a killed
        # server's loop running and this wait hanging at a failure (2026-11-28, seed 4 at 10 %, random)
        await cancel_and_wait([task], "a killed stage server")
        # Its DHT node is cleaned up off the clock: a killed server does not wait for anything.
        self.dead.append(asyncio.create_task(shutdown_dht(dht, timeout=5)))
        return await self.checkpoints.drop_pending()

    async def save_checkpoint(self) -> None:
        """Every stage writes (and uploads, or starts uploading) its checkpoint (Checkpoints.save), off the event loop
        so that the servers keep announcing; the training loop waits for all of them, so the time is charged to this
        strategy's wall clock, a wait for the last checkpoint's uploads in the background included."""
        started = time.perf_counter()
        # servers are kept by stage, or by arrival in churn mode: one file per stage
        backends = {server.index: server.backend for server, _, _ in self.servers.values()}
        waits = len(self.checkpoints.upload_waits_s)
        self.last_bytes = await self.checkpoints.save(backends, self.driver.step)
        seconds = time.perf_counter() - started
        self.saves_s.append(seconds)
        self.io_s += seconds
        # what the save itself blocks training for, without a wait for the last checkpoint's uploads: Young's price
        self.save_cost_s = seconds - sum(self.checkpoints.upload_waits_s[waits:])

    async def load_checkpoint(self, replaced: list[int] = ()) -> None:
        """Every stage, the new one too, reads its last checkpoint back; the driver goes back to its step. With
        stores, the servers of the `replaced` stages (new hosts) first download theirs."""
        started = time.perf_counter()
        backends = {server.index: server.backend for server, _, _ in self.servers.values()}
        self.driver.step = await self.checkpoints.load(backends, replaced)
        seconds = time.perf_counter() - started
        self.loads_s.append(seconds)
        self.io_s += seconds

    def checkpoint_bytes(self) -> int:
        """Size on disk of the last checkpoint of all stages (0 before the first)."""
        return self.last_bytes

    async def stop(self) -> None:
        await self.checkpoints.close()
        for store in self.checkpoints.stores:
            store.close()
        await asyncio.gather(*self.dead, return_exceptions=True)
        for stage in list(self.servers):
            server, task, dht = self.servers.pop(stage)
            await cancel_and_wait([task], "a stage server")
            await shutdown_dht(dht, timeout=5)
        if hasattr(self, "bootstrap"):  # not when the run stopped while starting
            await shutdown_dht(self.bootstrap, timeout=5)


def quiet_killed_daemons(loop, context) -> None:
    """hivemind's control-connection tasks of a killed p2p daemon end in ConnectionResetError: expected here, not
    news."""
    if isinstance(context.get("exception"), (ConnectionResetError, BrokenPipeError)):
        return
    loop.default_exception_handler(context)


async def run(
    args,
    scratch: Path,
    seed: int,
    strategy: str,
    rate: float,
    target: float | None,
    step_s: float | None = None,
    on_result=None,
    hold: LoadHold | None = None,
) -> dict:
    """One training run to the target (or, for `none`, --max-steps steps). `step_s`, a normal step of the failure-free
    run, sets checkpoint-restart's interval under Young's rule. With `hold` (--keep-load), once it has its result it
    hands it to `on_result` and keeps training until `hold` is released; the result is what it was at the target."""
    asyncio.get_running_loop().set_exception_handler(quiet_killed_daemons)
    bench = Bench(args, scratch, seed, strategy)
    schedule = (
        failure_schedule(seed, rate, args.max_steps, args.steps_per_hour, args.failures) if strategy != "none" else {}
    )
    record = {
        "curve": [],
        "losses": [],
        "recoveries": [],
        "spikes": [],
        "normal_step_s": [],
        "eval_s": 0.0,
        "every": None,
        "retries": 0,
        "repeated_calls": 0,
    }
    timed_out = False
    result = None
    try:
        try:
            async with asyncio.timeout(args.run_timeout_s):
                await bench.start()
                started = time.perf_counter()
                await train(bench, args, strategy, schedule, target, record, started, rate, step_s)
        except (
            TimeoutError,
            RuntimeError,
        ) as exc:  # too slow, or a stage server that never came up: a missed target, said so
            timed_out = True
            print(f"seed {seed} rate {rate:.2f} {strategy}: run stopped: {type(exc).__name__}: {exc}", flush=True)
        result = run_result(bench, record, schedule, seed, strategy, rate, target, timed_out)
        if on_result is not None:
            on_result(result)
        if hold is not None:
            hold.mark_reached(seed, rate, strategy)
            if not timed_out:
                await keep_training(bench, hold, args.run_timeout_s, f"seed {seed} rate {rate:.2f} {strategy}")
    finally:
        if hold is not None:
            hold.mark_reached(seed, rate, strategy)  # ended, even by an error: nothing beside it waits for it any more
        await bench.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    return result


async def keep_training(bench, hold: LoadHold, limit_s: float, name: str) -> None:
    """--keep-load: training steps (no failures, checkpoints or evaluation) until every run beside this one has
    reached its target or ended, so that they keep the load they ran under; at most `limit_s` (each of them stops
    itself at that limit too). A step that fails ends it: the row is already written."""
    steps = 0
    try:
        async with asyncio.timeout(limit_s):
            while not hold.released():
                await bench.driver.train_step()
                steps += 1
    except Exception as exc:  # noqa: BLE001 - the load it kept ends here; the figures were taken before
        print(f"{name}: stopped keeping the load after {steps} steps: {type(exc).__name__}: {exc}", flush=True)
        return
    print(f"{name}: kept the load for {steps} steps after its target", flush=True)


class LoadHold:
    """--keep-load's signals between the runs side by side and their parent, as files in one folder (the runs may be
    in network namespaces of their own, not in mount namespaces): a run marks that it reached its target or ended;
    the parent releases them all once every run has."""

    RELEASED = "released"

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)

    @staticmethod
    def name(seed: int, rate: float, strategy: str) -> str:
        return f"{seed}-{rate:g}-{strategy}"

    def mark_reached(self, seed: int, rate: float, strategy: str) -> None:
        (self.folder / self.name(seed, rate, strategy)).touch()

    def reached(self, seed: int, rate: float, strategy: str) -> bool:
        return (self.folder / self.name(seed, rate, strategy)).exists()

    def release(self) -> None:
        (self.folder / self.RELEASED).touch()

    def released(self) -> bool:
        return (self.folder / self.RELEASED).exists()

    def release_when_settled(self, children: list[subprocess.Popen], runs: list[tuple[int, float, str]]) -> bool:
        """Release the runs once each has reached its target or its process has ended (True when it did)."""
        if all(child.poll() is not None or self.reached(*spec) for child, spec in zip(children, runs, strict=True)):
            self.release()
        return self.released()


def run_result(bench, record, schedule, seed, strategy, rate, target, timed_out) -> dict:
    """The run's row (less its key), as it stands now: lists are copied, so that steps taken after (--keep-load)
    change nothing in it."""
    uplink_mb = None
    if bench.uplinks is not None:
        uplink_mb = {host: round(sent / 1e6, 3) for host, sent in sorted(bench.uplinks.sent_bytes().items())}
    curve = list(record["curve"])
    reached = next((point for point in curve if target is not None and point["val_loss"] <= target), None)
    return {
        "seed": seed,
        "strategy": strategy,
        "rate": rate,
        "parameters": sum(p.numel() for p in bench.model.parameters()) if hasattr(bench, "model") else None,
        "curve": curve,
        "losses": list(record["losses"]),  # [driver step, training loss] of every step executed, replays included
        "failures": sum(len(v) for k, v in schedule.items() if k <= getattr(getattr(bench, "driver", None), "step", 0)),
        "steps_to_target": reached["executed"] if reached else None,
        "wall_s_to_target": reached["wall_s"] if reached else None,
        "eval_s": record["eval_s"],
        "retries": record["retries"],
        "repeated_calls": record["repeated_calls"],  # sent again to the same server after a broken stream (answered)
        "recovery_s": [r["seconds"] for r in record["recoveries"]],
        "recoveries": list(record["recoveries"]),
        "loss_spike": list(record["spikes"]),
        "normal_step_s": statistics.median(record["normal_step_s"]) if record["normal_step_s"] else None,
        "checkpoint_every": record["every"],
        # what the interval was priced at: the save, and with young-with-uploads the steps beside its uploads too
        "checkpoint_cost_s": record.get("checkpoint_cost_s"),
        # young-own-steps: the normal step it was priced against, the run's own
        "priced_step_s": record.get("priced_step_s"),
        "checkpoint_saves_s": list(bench.saves_s),
        "checkpoint_loads_s": list(bench.loads_s),
        "checkpoint_bytes": bench.checkpoint_bytes(),
        "checkpoint_io_s": bench.io_s,
        # uploads in the background: each checkpoint's (seconds), each save's wait for the last one's, those cut
        "checkpoint_uploads_s": list(bench.checkpoints.uploads_s),
        "checkpoint_upload_waits_s": list(bench.checkpoints.upload_waits_s),
        "checkpoint_uploads_dropped": bench.checkpoints.uploads_dropped,
        # --checkpoint-uplinks per-host: what each host sent over its uplink in the whole run (MB)
        "uplink_mb_by_host": uplink_mb,
        "timed_out": timed_out,
    }


async def train(bench, args, strategy, schedule, target, record, started, rate, step_s) -> None:
    """Wall seconds exclude validation (the same evaluation for every strategy, and a rollback's replayed steps would
    evaluate twice); checkpoint saves and loads, recoveries and replayed steps are all in them."""
    executed, fired, failed, last_loss = 0, set(), None, None
    normal_step_s = record["normal_step_s"]
    # young-with-uploads, young-own-steps: the steps beside the first checkpoint's uploads, until they end (None: not
    # pricing)
    beside_uploads: list[float] | None = None
    own_steps = args.checkpoint_every == "young-own-steps"
    if strategy == "checkpoint":
        await bench.save_checkpoint()  # the restore point before step 1
    while executed < args.max_steps * 3:
        step = bench.driver.step + 1
        # each scheduled failure happens once, even when a rollback replays its step
        if step in schedule and step not in fired:
            fired.add(step)
            failed = {
                "at": time.perf_counter(),
                "step": step,
                "stages": schedule[step],
                "methods": [],
                "fetched_bytes": [],
            }
            for stage in schedule[step]:
                if await bench.kill(stage):
                    failed["uploads_cut"] = True
                server = await bench.start_server(stage)
                await bench.wait_serving(stage)
                event = last_recovery(server)
                failed["methods"].append("checkpoint" if strategy == "checkpoint" else event.get("method", "unknown"))
                # what the new server read from live neighbours (here over loopback; between hosts, over their links)
                failed["fetched_bytes"].append(event.get("bytes_fetched", 0))
            if strategy == "checkpoint":
                failed["replayed"] = bench.driver.step - bench.checkpoints.step
                await bench.load_checkpoint(schedule[step])
                failed["load_s"] = bench.loads_s[-1]
            failed["to_serving_s"] = time.perf_counter() - failed["at"]
        row = await bench.driver.train_step()
        executed += 1
        record["losses"].append([bench.driver.step, row["loss"]])
        if beside_uploads is not None and failed is None:  # the first step after a failure is the recovery's
            beside_uploads.append(row["step_s"])
        # calls retried or failed under load: a step that retried may differ from the failure-free run in its last bits
        record["retries"] += row["retries"] + row["backward_failures"] + sum(row["hop_failures"].values())
        record["repeated_calls"] += sum(row["repeated_calls"].values())
        if failed is not None:
            failed.pop("at")
            failed["recovery_step_s"] = row["step_s"]
            failed["seconds"] = recovery_seconds(
                failed["to_serving_s"], row["step_s"], statistics.median(normal_step_s) if normal_step_s else 0.0
            )
            record["recoveries"].append(failed)
            if last_loss is not None:
                record["spikes"].append(row["loss"] - last_loss)
            failed = None
        else:
            normal_step_s.append(row["step_s"])
        last_loss = row["loss"]
        if beside_uploads is not None and (bench.checkpoints.pending is None or bench.checkpoints.pending.done()):
            # the first checkpoint's uploads ended (or a failure cut them: priced on the steps they had)
            record["checkpoint_cost_s"] = cost_with_uploads(bench.save_cost_s, beside_uploads, step_s or 0.0)
            record["every"] = checkpoint_every(args, record["checkpoint_cost_s"], step_s, rate)
            print(
                f"seed {bench.seed} rate {rate:.2f} checkpoint: a checkpoint costs {record['checkpoint_cost_s']:.2f}s "
                f"with the {len(beside_uploads)} steps beside its uploads; every {record['every']} steps",
                flush=True,
            )
            beside_uploads = None
        elif (
            strategy == "checkpoint"
            and record["every"] is None
            and "checkpoint_cost_s" not in record
            and (not own_steps or own_normal_step(normal_step_s) is not None)
        ):
            # The checkpoint after step 1 sets the interval: the one before it holds no AdamW moments yet (a third of
            # the bytes), this one is the size of every later one. With young-own-steps it comes after OWN_STEPS more
            # normal steps, and this run's own normal step prices it: the failure-free run's, taken at another load
            # (4.3 s alone against the run's median of 10.4 s, seed 0 at 16 %) gave 23 steps where that one gives 11.
            if own_steps:
                step_s = record["priced_step_s"] = own_normal_step(normal_step_s)
            await bench.save_checkpoint()
            record["checkpoint_cost_s"] = bench.save_cost_s
            if args.checkpoint_every in PRICED_WITH_UPLOADS and bench.checkpoints.background:
                beside_uploads = []  # priced once its uploads end; no checkpoint until then
            else:
                record["every"] = checkpoint_every(args, bench.save_cost_s, step_s, rate)
                print(
                    f"seed {bench.seed} rate {rate:.2f} checkpoint: a checkpoint costs {bench.save_cost_s:.2f}s for "
                    f"{bench.checkpoint_bytes() / 1e6:.1f} MB; every {record['every']} steps",
                    flush=True,
                )
        elif strategy == "checkpoint" and record["every"] and bench.driver.step % record["every"] == 0:
            await bench.save_checkpoint()
        if bench.driver.step % args.eval_every == 0:
            evaluated = time.perf_counter()
            val = await bench.driver.validation_loss()
            record["eval_s"] += time.perf_counter() - evaluated
            record["curve"].append(
                {
                    "step": bench.driver.step,
                    "executed": executed,
                    "wall_s": time.perf_counter() - started - record["eval_s"],
                    "val_loss": val,
                }
            )
            point = record["curve"][-1]
            print(
                f"  seed {bench.seed} rate {rate:.2f} {strategy}: step {point['step']} ({executed} executed) val loss "
                f"{val:.4f} at {point['wall_s']:.1f}s (target {target})",
                flush=True,
            )
            if target is not None and val <= target:
                break
        if bench.driver.step >= (args.max_steps if target is None else 2 * args.max_steps):
            break


def recovery_seconds(to_serving_s: float, recovery_step_s: float, normal_step_s: float) -> float:
    """What a failure stalled training for: from the failure until its stage serves again (the replacement's start
    and weight transfer, a checkpoint's download and load), plus what the first step after it took beyond a normal
    step (the driver's failed hop, its wait for the new announcement, retries). That excess is taken as at least 0:
    on a loaded machine one step can run seconds faster than the median step, and subtracting the median from the
    whole span made recoveries of -7.5 s (benchmarks/notebook/2026-12-01-stage-recovery.md, 27M at 16 %)."""
    return to_serving_s + max(0.0, recovery_step_s - normal_step_s)


def last_recovery(server: StageServer) -> dict:
    """How a new server got its stage's weights (method: checkfree, checkfree_plus, random, ...; bytes_fetched), from
    its recovery log; {} if it wrote none."""
    log_file = server.state_dir / "recoveries.jsonl"
    lines = log_file.read_text().splitlines() if log_file.exists() else []
    return json.loads(lines[-1]) if lines else {}
