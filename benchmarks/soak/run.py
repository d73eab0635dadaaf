"""A soak in the swarm lab: `join` nodes (two behind home routers), a pipeline of stage servers with a spare and its
driver, each its own process in its own network namespace, and faults injected one at a time on a schedule. What
each fault did, and what the nodes' files say at the end, is the soak's result (benchmarks/soak/figures.py).

Each fault is injected, held, lifted, and then waited on until the process it hit has exchanged with a peer again
(trained on a peer's questions since the fault ended, by its swarm.json; for the pipeline, the driver's next step),
for at most `recover_timeout_s`. Between faults the soak only watches: every `poll_s` it samples each process's RSS
and, while a p2p daemon fault is on, the node's /readyz; a process that exits without the soak killing it is a
crash: counted, and started again as a supervisor (systemd, compose) would.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from benchmarks.lab import REPO, Lab
from benchmarks.lab.presets import lab_command
from benchmarks.soak import figures
from benchmarks.soak.faults import FAULTS
from benchmarks.soak.figures import Downtime
from benchmarks.soak.plan import (
    NODE_FAULTS,
    JOIN_SETS,
    LIBFAKETIME,
    LISTENING,
    PIPELINE_SETS,
    RELAY_PORT,
    RESUMED,
    STATE_DISK_MB,
    Event,
    SoakPlan,
)


class Soak:
    def __init__(self, plan: SoakPlan, root: Path, env: dict[str, str], log=print):
        self.plan, self.root, self.env, self.log = plan, root, env, log
        self.lab = Lab(plan.lab_nodes, host_link=False, nat={node: k for k, node in enumerate(plan.natted)})
        self.events: list[Event] = []
        self.crashes: list[dict] = []
        self.downtimes: list[Downtime] = []
        self.rss: dict[int, list[tuple[float, float]]] = {}
        self.started_at: dict[int, float] = {}
        self.on_purpose_down: set[int] = set()
        self.readyz: dict[int, list[tuple[float, int]]] = {}
        self.watch_ready: set[int] = set()
        self.mounted: list[Path] = []
        self.clock_file = root / "clock-offset"
        self.began = time.time()
        self.join_config = root / "join.yaml"
        self.pipeline_config = root / "pipeline.yaml"

    # places ------------------------------------------------------------------------------------

    def state(self, index: int) -> Path:
        return self.root / f"n{index}"

    def node_id(self, index: int) -> str:
        from protocol import NodeIdentity

        return NodeIdentity.load_or_create(self.state(index) / "identity.key").node_id

    # start and stop ----------------------------------------------------------------------------

    def __enter__(self) -> Soak:
        self.lab.up()
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.lab.down()
        for path in self.mounted:
            subprocess.run(["umount", "--lazy", str(path)], capture_output=True)

    def write_configs(self) -> None:
        from node.config import dump_config, load_config
        from node.model import ensure_default_model

        for path, base, sets in (
            (self.join_config, "swarm.yaml", JOIN_SETS),
            (self.pipeline_config, "pipeline.yaml", PIPELINE_SETS),
        ):
            config = load_config(REPO / "configs" / base, sets)
            ensure_default_model(config, progress=False)  # built once, before the processes race to build it
            path.write_text(dump_config(config))

    def argv(self, index: int, command: str, config: Path, extra: list[str] = (), peers: list[str] = ()) -> list[str]:
        port = RELAY_PORT if index == 0 else 0
        return lab_command(
            command,
            self.state(index),
            self.lab.ip(index),
            f"soak-{index}",
            config=config,
            port=port,
            extra=extra,
            peers=peers,
        )

    def env_of(self, index: int) -> dict[str, str]:
        if "clock_jump" in self.plan.faults and index == self.plan.target("clock_jump"):
            # libfaketime 0.9.10 moves CLOCK_MONOTONIC with the wall clock: with FAKETIME_DONT_FAKE_MONOTONIC its
            # clock_nanosleep fails (EINVAL) and Python's time.sleep with it. So a jump moves both clocks forward,
            # as a process frozen for that long sees, and they go back only for a process started anew: the fault
            # restarts the node once its clock is set right.
            return {
                **self.env,
                "LD_PRELOAD": str(LIBFAKETIME),
                "FAKETIME_TIMESTAMP_FILE": str(self.clock_file),
                "FAKETIME_CACHE_DURATION": "1",
            }
        return self.env

    def launch(self, index: int, argv: list[str]) -> subprocess.Popen:
        popen = self.lab.run(index, argv, self.root / f"n{index}.out", self.env_of(index))
        self.started_at[index] = time.time()
        return popen

    def address(self, index: int, timeout_s: float) -> str:
        path, ip = self.state(index) / "addresses.txt", self.lab.ip(index)

        def listening() -> str | None:
            if not self.lab.alive(index):
                raise RuntimeError(f"process {index} exited before listening: {self.tail(index)}")
            lines = path.read_text().split() if path.exists() else []
            return next((a for a in lines if f"/ip4/{ip}/" in a), None)

        found = self.wait(listening, timeout_s)
        if found is None:
            raise RuntimeError(f"process {index} did not listen in {timeout_s:.0f} s: {self.tail(index)}")
        return found

    def start(self) -> None:
        plan = self.plan
        if shutil.which("curl") is None:
            raise RuntimeError("the soak asks each node's /readyz with curl (Debian: apt install curl)")
        self.write_configs()
        if "clock_jump" in plan.faults:
            if not LIBFAKETIME.exists():
                raise RuntimeError(f"the clock jump needs libfaketime ({LIBFAKETIME}; Debian: apt install faketime)")
            self.clock_file.write_text("+0\n")
        if "disk_full" in plan.faults:
            disk = self.state(plan.target("disk_full"))
            disk.mkdir(parents=True)
            mounted = subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={STATE_DISK_MB}m", "tmpfs", str(disk)], capture_output=True
            )
            if mounted.returncode != 0:
                raise RuntimeError(f"cannot mount a tmpfs for the full disk: {mounted.stderr.decode().strip()}")
            self.mounted.append(disk)
        self.launch(0, self.argv(0, "join", self.join_config, ["--fresh"]))
        self.bootstrap = self.address(0, plan.start_timeout_s)
        for index in range(1, plan.join_nodes):
            self.launch(index, self.argv(index, "join", self.join_config, ["--fresh"], [self.bootstrap]))
        if plan.stages:
            sets = ["--set", f"pipeline.num_stages={plan.stages}"]
            first = plan.stage_index(0)
            self.launch(first, self.argv(first, "serve", self.pipeline_config, ["--stage", "0", *sets]))
            self.pipeline_bootstrap = self.address(first, plan.start_timeout_s)
            for stage in range(1, plan.stages):
                index = plan.stage_index(stage)
                extra = ["--stage", str(stage), *sets]
                self.launch(index, self.argv(index, "serve", self.pipeline_config, extra, [self.pipeline_bootstrap]))
            for spare in range(plan.spares):
                index = plan.spare_index(spare)
                extra = ["--stage", "spare", *sets]
                self.launch(index, self.argv(index, "serve", self.pipeline_config, extra, [self.pipeline_bootstrap]))
            self.launch(
                plan.driver, self.argv(plan.driver, "drive", self.pipeline_config, sets, [self.pipeline_bootstrap])
            )
        # under way: every join node has trained on a peer's questions, the driver has stepped
        for index in range(plan.join_nodes):
            if self.wait(lambda: self.exchanged(index, {}, since=0), plan.start_timeout_s) is None:
                raise RuntimeError(f"node {index} never trained on a peer's questions: {self.tail(index)}")
        if plan.stages and self.wait(lambda: self.driver_step_after(0), plan.start_timeout_s) is None:
            raise RuntimeError(f"the driver never stepped: {self.tail(plan.driver)}")
        self.began = time.time()
        self.log(f"soak: under way, {plan.lab_nodes - 1} processes")

    # watching ----------------------------------------------------------------------------------

    def tail(self, index: int, chars: int = 2000) -> str:
        path = self.root / f"n{index}.out"
        return path.read_text(errors="replace")[-chars:] if path.exists() else "(no output)"

    def tick(self) -> None:
        now = time.time()
        for index, proc in list(self.lab.processes.items()):
            if index == self.plan.hostile:
                continue
            if proc.popen.poll() is None:
                with contextlib.suppress(OSError, ValueError):
                    status = Path(f"/proc/{proc.popen.pid}/status").read_text()
                    kib = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
                    self.rss.setdefault(index, []).append((now, kib / 1024))
            elif index not in self.on_purpose_down:
                self.crashes.append(
                    {
                        "index": index,
                        "at_s": round(now - self.began, 1),
                        "returncode": proc.popen.returncode,
                        "output_tail": self.tail(index, 1500),
                    }
                )
                self.log(f"soak: process {index} exited by itself ({proc.popen.returncode}); starting it again")
                self.downtimes.append(Downtime(index, now - self.plan.poll_s, now))
                self.lab.restart(index, self.env_of(index))
                self.started_at[index] = now
        for index in self.watch_ready:
            self.readyz.setdefault(index, []).append((now, self.ready_code(index)))

    def ready_code(self, index: int) -> int:
        """The HTTP status of the process's /readyz, asked from its own namespace (0: no answer)."""
        url = (self.state(index) / "http.txt").read_text().strip() if (self.state(index) / "http.txt").exists() else ""
        if not url:
            return 0
        asked = subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                self.lab.ns(index),
                "curl",
                "-s",
                "-m",
                "3",
                "-o",
                "/dev/null",
                "-w",
                "%{http_code}",
                url.rstrip("/") + "/readyz",
            ],
            capture_output=True,
            text=True,
        )
        return int(asked.stdout) if asked.stdout.isdigit() else 0

    def wait(self, predicate, timeout_s: float, interval_s: float = 1.0):
        """The predicate's first true value, watching meanwhile; None when `timeout_s` passed first."""
        deadline = time.monotonic() + timeout_s
        next_tick = 0.0
        while True:
            if time.monotonic() >= next_tick:
                self.tick()
                next_tick = time.monotonic() + self.plan.poll_s
            value = predicate()
            if value:
                return value
            if time.monotonic() >= deadline:
                return None
            time.sleep(interval_s)

    def sleep(self, seconds: float) -> None:
        self.wait(lambda: False, seconds)

    def exchanged(self, index: int, baseline: dict[str, int], since: float, peers: set[str] | None = None):
        """When node `index` had trained on more of some peer's questions (of `peers`, default any) than `baseline`
        by a swarm.json written after `since` (None: not yet)."""
        path = self.state(index) / "swarm.json"
        try:
            written = path.stat().st_mtime
        except OSError:
            return None
        if written < since:
            return None
        used = figures.used_by_peer(self.state(index))
        if any(count > baseline.get(peer, 0) for peer, count in used.items() if peers is None or peer in peers):
            return written
        return None

    def logged(self, index: int, needle: str) -> int:
        """How many lines of process `index`'s node.log hold `needle`."""
        path = self.running_state(index) / "node.log"
        return path.read_text(errors="replace").count(needle) if path.exists() else 0

    def driver_step_after(self, moment: float):
        rows = figures.read_rows(self.state(self.plan.driver))
        return next((r["time"] for r in rows if r.get("time", 0) > moment), None)

    def first_row_after(self, index: int, moment: float, timeout_s: float) -> float | None:
        rows = lambda: [r["time"] for r in figures.read_rows(self.state(index)) if r.get("time", 0) > moment]  # noqa: E731
        return self.wait(lambda: (found := rows()) and found[0], timeout_s)

    # faults ------------------------------------------------------------------------------------

    def down(self, index: int, sig: int = signal.SIGKILL) -> float:
        self.on_purpose_down.add(index)
        at = time.time()
        self.lab.kill(index, sig)
        return at

    def up(self, index: int, argv: list[str] | None = None) -> float:
        if argv is None:
            self.lab.restart(index, self.env_of(index))
        else:
            self.lab.run(index, argv, self.root / f"n{index}.out", self.env_of(index))
        self.on_purpose_down.discard(index)
        self.started_at[index] = at = time.time()
        return at

    def restarted_node(self, event: Event, index: int, killed: float) -> None:
        """Node `index` was killed at `killed` and is up again: its downtime lasts to its first round after, and
        its recovery is its first exchange after it came back."""
        back = event.end
        first = self.first_row_after(index, back, self.plan.recover_timeout_s)
        self.downtimes.append(Downtime(index, killed, first))
        event.recovered[index] = self.wait(lambda: self.exchanged(index, {}, back), self.plan.recover_timeout_s)
        event.details["restart_s"] = self.restart_moments(index, back, first, event.recovered[index])

    def restart_moments(self, index: int, back: float, first_row: float | None, exchanged: float | None) -> dict:
        """Where a restarted process's time went, in seconds after it was started: its policy resumed (the imports
        included), it listened on the swarm, it ended its first round, it trained on a peer's questions."""
        log = self.running_state(index) / "node.log"
        return {
            "resumed": figures.logged_after(log, RESUMED, back),
            "joined": figures.logged_after(log, LISTENING, back),
            "first_round": None if first_row is None else round(first_row - back, 1),
            "exchanged": None if exchanged is None else round(exchanged - back, 1),
        }

    def round_with_peers_after(self, index: int, moment: float):
        """When node `index` ended a round after `moment` (by its own clock) that trained on a peer's questions."""
        rows = figures.read_rows(self.state(index))
        return next((r["time"] for r in rows if r.get("time", 0) > moment and r.get("external_questions", 0)), None)

    def server_of(self, stage: int) -> int | None:
        for index in [self.plan.stage_index(s) for s in range(self.plan.stages)] + [
            self.plan.spare_index(s) for s in range(self.plan.spares)
        ]:
            if not self.lab.alive(index):
                continue
            try:
                if json.loads((self.running_state(index) / "stage.json").read_text()).get("stage") == stage:
                    return index
            except (OSError, ValueError):
                continue
        return None

    def running_state(self, index: int) -> Path:
        """The state directory process `index` runs in now (a killed stage server comes back as a spare elsewhere)."""
        argv = self.lab.processes[index].argv
        return Path(argv[argv.index("--state-dir") + 1])

    def serving_since(self, index: int, moment: float) -> float | None:
        """When stage server `index` last wrote that it serves a stage, if after `moment` (None: not yet)."""
        path = self.running_state(index) / "stage.json"
        try:
            written = path.stat().st_mtime
            serving = json.loads(path.read_text()).get("state") == "serving"
        except (OSError, ValueError):
            return None
        return written if serving and written > moment else None

    # the schedule ------------------------------------------------------------------------------

    def run(self, hours: float | None = None) -> dict:
        """The fault list `plan.cycles` times over, or (with `hours`) over again until that long has passed."""
        cycle = 0
        while cycle < self.plan.cycles if hours is None else time.time() - self.began < hours * 3600 or cycle == 0:
            cycle += 1
            for kind in self.plan.faults:
                # a node kind's target is fixed; the others name theirs as they run (the cut, the server of stage 1)
                event = Event(kind, self.plan.target(kind) if kind in NODE_FAULTS else 0, time.time())
                self.log(f"soak: cycle {cycle}: {kind} at {time.time() - self.began:.0f} s")
                FAULTS[kind](self, event)
                self.events.append(event)
                self.log(f"soak:   on {event.target}: recovered in {event.recovery_s()} s {event.details or ''}")
                self.sleep(self.plan.gap_s)
        return self.result()

    def result(self) -> dict:
        """The figures: whether every process is alive, then (once each is stopped as a user stops it, Ctrl-C)
        what their files hold."""
        plan, ended = self.plan, time.time()
        alive = {i: self.lab.alive(i) for i in self.lab.processes if i != plan.hostile}
        printed = {i: len(self.tail(i, 10**9)) for i in alive}
        self.lab.down()  # SIGINT to each, SIGKILL only after 20 s: a checkpoint is never read while being pruned
        stops = {i: self.lab.processes[i].popen.returncode for i in alive}
        stop_tracebacks = [i for i in alive if "Traceback" in self.tail(i, 10**9)[printed[i] :]]
        tracebacks = {i: n for i in alive if (n := self.tail(i, 10**9).count("Traceback"))}
        # the state root is usually temporary: what each process's last traceback said must outlive it
        last_traceback = {
            i: printed_text[printed_text.rindex("Traceback") :][:2000]
            for i in tracebacks
            if (printed_text := self.tail(i, 10**9))
        }
        workers = [i for i in alive if i < plan.join_nodes] + ([plan.driver] if plan.stages else [])
        rows = {i: figures.read_rows(self.state(i)) for i in workers}
        gaps = {}
        for i in workers:
            # a clock jump's rows are stamped ahead until the node restarts with the clock set right: that restart's
            # downtime covers the stretch from the last row before the jump to the first after it
            downtimes = [d for d in self.downtimes if d.index == i]
            found = figures.row_gaps([r for r in rows[i] if r.get("time", 0) >= self.began], downtimes)
            gaps[i] = round(max((s for _, s in found), default=0.0), 1)
        by_kind: dict[str, list[float | None]] = {}
        for event in self.events:
            if not event.details.get("skipped") and not event.details.get("error"):
                by_kind.setdefault(event.kind, []).append(event.recovery_s())
        rss = {
            i: figures.rss_growth(self.rss.get(i, []), self.started_at.get(i, 0), plan.rss_baseline_s) for i in alive
        }
        ratios = [g["ratio"] for g in rss.values() if g]
        restarts = [e.details["restart_s"] for e in self.events if "restart_s" in e.details]
        restart_breakdown = {
            moment: figures.spread([r[moment] for r in restarts])
            for moment in ("resumed", "joined", "first_round", "exchanged")
        }
        readyz = [
            {k: e.details.get(k) for k in ("not_ready_after_s", "ready_again_after_s")}
            for e in self.events
            if e.kind == "p2pd_kill"
        ]
        return {
            "benchmark": "soak",
            "date": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()),
            "plan": dataclasses.asdict(plan),
            "hours": round((ended - self.began) / 3600, 3),
            "load_average": os.getloadavg(),
            "crashes": len(self.crashes),
            "crash_details": self.crashes,
            "alive_at_end": all(alive.values()),
            "exit_codes_on_stop": stops,  # 0: stopped cleanly on the first Ctrl-C
            "tracebacks_on_stop": stop_tracebacks,
            "tracebacks": tracebacks,  # printed over the whole soak, per process (the faults' own included)
            "last_traceback": last_traceback,  # its first 2,000 characters, per process that printed one
            "max_stall_s": gaps,
            "max_stall_s_overall": max(gaps.values(), default=None),
            "recovery_s_by_kind": {
                kind: (None if None in values else round(max(values), 1)) for kind, values in by_kind.items()
            },
            # the processes the soak started again (node kill, relay, damaged checkpoint, clock): seconds from their
            # start to each moment, median and max over those restarts
            "restart_breakdown_s": restart_breakdown,
            "rows_contiguous": {
                i: figures.contiguous(rows[i], "step" if i == plan.driver else "round") for i in workers
            },
            "versions_forward": {i: figures.versions_forward(rows[i]) for i in workers if i != plan.driver},
            "unloadable_checkpoints": {
                i: figures.unloadable_checkpoints(self.state(i)) for i in range(plan.join_nodes)
            },
            "rss": rss,
            "rss_max_ratio": max(ratios, default=None),
            "readyz": readyz,
            "events": [
                {
                    "kind": e.kind,
                    "target": e.target,
                    "at_s": round(e.start - self.began, 1),
                    "lifted_after_s": None if e.end is None else round(e.end - e.start, 1),
                    "recovery_s": None if e.recovery_s() is None else round(e.recovery_s(), 1),
                    "recovered_at_s": {
                        i: None if t is None else round(t - self.began, 1) for i, t in e.recovered.items()
                    },
                    "details": e.details,
                }
                for e in self.events
            ],
        }
