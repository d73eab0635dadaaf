"""The soak's faults, one function a kind: each injects its fault into a running `Soak`, holds it, lifts it, and
waits until every process it hit has exchanged with a peer again, recording when in its `Event`."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks.lab.network import p2p_daemon_of
from benchmarks.soak import figures
from benchmarks.soak.plan import CLOCK_JUMP_S, CLOCK_SAID, REJOINED, Event

if TYPE_CHECKING:
    from benchmarks.soak.run import Soak


def p2pd_kill(soak: Soak, event: Event) -> None:
    index = event.target
    daemon = p2p_daemon_of(soak.lab.processes[index].popen.pid)
    if daemon is None:
        event.details["error"] = "no p2pd child found"
        return
    event.details["ready_before"] = bool(soak.wait(lambda: soak.ready_code(index) == 200, 120))
    rejoins = soak.logged(index, REJOINED)
    soak.watch_ready.add(index)
    soak.readyz[index] = []
    event.start = time.time()
    os.kill(daemon, signal.SIGKILL)
    event.end = event.start
    # a round in flight may still train on peers' groups read before the kill: the exchange that counts is one
    # over the new daemon, after the node said it rejoined
    rejoined = soak.wait(lambda: soak.logged(index, REJOINED) > rejoins and time.time(), soak.plan.recover_timeout_s)
    event.details["rejoined_after_s"] = None if rejoined is None else round(rejoined - event.start, 1)
    baseline = figures.used_by_peer(soak.state(index))
    event.recovered[index] = rejoined and soak.wait(
        lambda: soak.exchanged(index, baseline, rejoined), soak.plan.recover_timeout_s
    )
    samples = lambda: soak.readyz.get(index, [])  # noqa: E731
    not_ready = lambda: figures.first_after(samples(), event.start, lambda code: code != 200)  # noqa: E731
    soak.wait(lambda: not_ready() and figures.first_after(samples(), not_ready(), lambda c: c == 200), 120, 0.5)
    soak.watch_ready.discard(index)
    went, came = not_ready(), None
    if went is not None:
        came = figures.first_after(samples(), went, lambda code: code == 200)
    event.details.update(
        p2pd_pid=daemon,
        p2pd_again=p2p_daemon_of(soak.lab.processes[index].popen.pid),
        not_ready_after_s=None if went is None else round(went - event.start, 1),
        ready_again_after_s=None if came is None else round(came - event.start, 1),
    )


def relay_restart(soak: Soak, event: Event) -> None:
    natted = list(soak.plan.natted)
    killed = event.start = soak.down(0)
    soak.sleep(soak.plan.down_s)
    (soak.state(0) / "addresses.txt").unlink(missing_ok=True)
    event.end = soak.up(0)
    again = soak.address(0, soak.plan.recover_timeout_s)
    event.details["same_address"] = again == soak.bootstrap
    for index in natted:
        event.recovered[index] = soak.wait(
            lambda: soak.round_with_peers_after(index, event.end), soak.plan.recover_timeout_s
        )
    soak.restarted_node(event, 0, killed)


def partition(soak: Soak, event: Event) -> None:
    cut = sorted(soak.plan.cut)
    outside = {soak.node_id(i) for i in range(soak.plan.join_nodes) if i not in cut}
    event.target = cut
    soak.lab.partition(set(cut))
    soak.sleep(soak.plan.fault_s)
    baselines = {i: figures.used_by_peer(soak.state(i)) for i in cut}
    soak.lab.heal()
    event.end = time.time()
    for index in cut:
        event.recovered[index] = soak.wait(
            lambda: soak.exchanged(index, baselines[index], event.end, outside), soak.plan.recover_timeout_s
        )


def node_kill(soak: Soak, event: Event) -> None:
    index = event.target
    killed = event.start = soak.down(index)
    soak.sleep(soak.plan.down_s)
    event.end = soak.up(index)
    soak.restarted_node(event, index, killed)


def hostile_peer(soak: Soak, event: Event) -> None:
    index = soak.plan.hostile
    joined = list(range(soak.plan.join_nodes))
    refused_before = {i: refused(soak.state(i)) for i in joined}
    out = soak.root / "hostile.json"
    out.unlink(missing_ok=True)
    event.start = time.time()
    soak.lab.run(
        index,
        [
            sys.executable,
            "-m",
            "benchmarks.soak.hostile",
            "--initial-peers",
            soak.bootstrap,
            "--swarm-id",
            "soak",
            "--host",
            soak.lab.ip(index),
            "--seconds",
            str(soak.plan.fault_s),
            "--out",
            str(out),
        ],
        soak.root / "hostile.out",
        soak.env,
    )
    started = out.with_suffix(".started")
    started.unlink(missing_ok=True)
    began = soak.wait(lambda: started.exists() and started.stat().st_mtime, soak.plan.recover_timeout_s)
    if began:
        event.start = began
    # under attack, every node goes on exchanging: its first exchange after the attack began
    for i in joined:
        event.recovered[i] = soak.wait(
            lambda: soak.round_with_peers_after(i, event.start), soak.plan.fault_s + soak.plan.recover_timeout_s
        )
    soak.wait(lambda: out.exists() or not soak.lab.alive(index), soak.plan.fault_s + 120)
    event.end = event.start  # the figure is from the attack's start: nodes must not wait for it to end
    ended = out.stat().st_mtime if out.exists() else time.time()
    event.details["longest_without_peers_s"] = {
        i: longest_without_peers(figures.read_rows(soak.state(i)), event.start, ended) for i in joined
    }
    hostile_log = soak.root / "hostile.out"
    if not out.exists():
        event.details["error"] = "the hostile peer did not run (its output: details.hostile)"
    event.details["hostile"] = (
        json.loads(out.read_text()) if out.exists() else {"error": hostile_log.read_text(errors="replace")[-1500:]}
    )
    event.details["refused_by_node"] = {i: refused(soak.state(i)) - refused_before[i] for i in joined}


def disk_full(soak: Soak, event: Event) -> None:
    index = event.target
    disk = soak.state(index)
    baseline = figures.used_by_peer(disk)
    filler = disk / "filler"
    with open(filler, "wb", buffering=0) as handle:
        with contextlib.suppress(OSError):
            while True:
                handle.write(b"\0" * (1 << 20))
        with contextlib.suppress(OSError):
            while handle.write(b"\0" * 4096):
                pass
    event.start = time.time()
    event.details["free_bytes_while_full"] = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
    soak.sleep(soak.plan.fault_s)
    filler.unlink()
    event.end = time.time()
    saved = lambda: latest_checkpoint_after(disk, event.end)  # noqa: E731
    event.recovered[index] = soak.wait(
        lambda: saved() and soak.exchanged(index, baseline, event.end), soak.plan.recover_timeout_s
    )
    log = (disk / "node.log").read_text(errors="replace") if (disk / "node.log").exists() else ""
    event.details["named_no_space"] = "no space left on device" in log


def checkpoint_damage(soak: Soak, event: Event) -> None:
    index = event.target
    state = soak.state(index)
    event.start = time.time()
    soak.on_purpose_down.add(index)
    soak.lab.kill(index, signal.SIGSTOP)  # frozen: it cannot write a newer checkpoint meanwhile
    latest = (state / "checkpoints" / "LATEST").read_text().strip()
    weights = state / "checkpoints" / latest / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as handle:
        handle.truncate(size // 2)
    event.details.update(damaged=f"{latest}/model.safetensors", bytes_before=size)
    killed = soak.down(index)
    event.end = soak.up(index)
    soak.restarted_node(event, index, killed)
    log = (state / "node.log").read_text(errors="replace") if (state / "node.log").exists() else ""
    event.details["fell_back"] = "resuming from" in log and latest in log


def clock_jump(soak: Soak, event: Event) -> None:
    """The node's clock jumps CLOCK_JUMP_S ahead, as a resumed VM's or a bad RTC's does: past the rollouts' age bound,
    so it can no longer use its peers' rollouts, nor they its records. It must say so, with the figure, while the fault
    lasts (fault_s, or until it says so); then its operator sets the clock right and restarts it (a running process's
    clocks cannot go back under libfaketime: see Soak.env_of). Its recovery is its next exchange after the restart."""
    index = event.target
    said_before = soak.logged(index, CLOCK_SAID)
    event.start = time.time()
    soak.clock_file.write_text(f"+{CLOCK_JUMP_S}\n")
    said = soak.wait(lambda: soak.logged(index, CLOCK_SAID) > said_before and time.time(), soak.plan.recover_timeout_s)
    event.details["said_after_s"] = None if said is None else round(said - event.start, 1)
    log = soak.running_state(index) / "node.log"
    figures_said = re.findall(CLOCK_SAID + r" (\d+) s ahead", log.read_text(errors="replace")) if log.exists() else []
    event.details["said_ahead_s"] = int(figures_said[-1]) if said is not None and figures_said else None
    soak.sleep(max(0.0, event.start + soak.plan.fault_s - time.time()))
    killed = soak.down(index, signal.SIGTERM)  # how an operator restarts it: a clean stop
    if soak.lab.alive(index):
        soak.down(index)
    soak.clock_file.write_text("+0\n")
    event.end = soak.up(index)
    soak.restarted_node(event, index, killed)


def stage_kill(soak: Soak, event: Event) -> None:
    index = soak.server_of(1)
    if index is None:
        event.details["error"] = "no process serves stage 1"
        return
    event.target = index
    event.start = soak.down(index)
    event.end = event.start
    # a step in flight may end just after the kill without the lost stage: the one that counts comes after
    # another server took stage 1
    taken = soak.wait(lambda: soak.server_of(1) is not None and time.time(), soak.plan.recover_timeout_s)
    event.details["taken_by"] = soak.server_of(1)
    event.details["taken_after_s"] = None if taken is None else round(taken - event.start, 1)
    event.recovered[soak.plan.driver] = taken and soak.wait(
        lambda: soak.driver_step_after(taken), soak.plan.recover_timeout_s
    )
    # back as a spare, in a state directory of its own (its old one holds stage 1's server)
    argv = soak.lab.processes[index].argv
    respawn = soak.state(index).with_name(f"n{index}-spare{sum(e.kind == 'stage_kill' for e in soak.events)}")
    argv = [str(respawn) if a == str(soak.state(index)) else a for a in argv]
    at = argv.index("--stage")
    argv[at + 1] = "spare"
    soak.up(index, argv)


def pipeline_p2pd_kill(soak: Soak, event: Event) -> None:
    driver, server = soak.plan.driver, soak.server_of(soak.plan.stages - 1)
    if server is None:
        event.details["error"] = "no process serves the last stage"
        return
    daemons = {index: p2p_daemon_of(soak.lab.processes[index].popen.pid) for index in (server, driver)}
    if None in daemons.values():
        event.details["error"] = f"no p2pd child found: {daemons}"
        return
    rejoins = {index: soak.logged(index, REJOINED) for index in daemons}
    event.target = [server, driver]
    event.start = time.time()
    for daemon in daemons.values():
        os.kill(daemon, signal.SIGKILL)
    event.end = event.start
    timeout = soak.plan.recover_timeout_s
    rejoined = {
        index: soak.wait(lambda index=index: soak.logged(index, REJOINED) > rejoins[index] and time.time(), timeout)
        for index in daemons
    }
    event.details["rejoined_after_s"] = {
        i: None if t is None else round(t - event.start, 1) for i, t in rejoined.items()
    }
    if None in rejoined.values():
        return
    # the server: serving a stage again over its new session (its stage.json says so); the driver: a step after both
    # rejoined, which went through every stage
    event.recovered[server] = soak.wait(lambda: soak.serving_since(server, rejoined[server]), timeout)
    event.recovered[driver] = soak.wait(lambda: soak.driver_step_after(max(rejoined.values())), timeout)
    event.details["p2pd_again"] = {i: p2p_daemon_of(soak.lab.processes[i].popen.pid) for i in daemons}


FAULTS = {
    "p2pd_kill": p2pd_kill,
    "relay_restart": relay_restart,
    "partition": partition,
    "node_kill": node_kill,
    "hostile_peer": hostile_peer,
    "disk_full": disk_full,
    "checkpoint_damage": checkpoint_damage,
    "clock_jump": clock_jump,
    "stage_kill": stage_kill,
    "pipeline_p2pd_kill": pipeline_p2pd_kill,
}


def longest_without_peers(rows: list[dict], start: float, end: float) -> float:
    """The longest stretch of [start, end] in which a node ended no round that trained on a peer's questions."""
    times = [r["time"] for r in rows if start <= r.get("time", 0) <= end and r.get("external_questions", 0)]
    edges = [start, *times, end]
    return round(max(b - a for a, b in zip(edges, edges[1:])), 1)


def refused(state_dir: Path) -> int:
    """Values this node refused so far: DHT records, peers' batches and heartbeats (swarm.json's totals)."""
    totals = figures.swarm_totals(state_dir)
    return sum(
        sum((totals.get(key) or {}).values()) for key in ("dht_records_rejected", "rejected", "heartbeats_rejected")
    )


def latest_checkpoint_after(state_dir: Path, moment: float) -> bool:
    pointer = state_dir / "checkpoints" / "LATEST"
    with contextlib.suppress(OSError):
        return pointer.stat().st_mtime > moment
    return False
