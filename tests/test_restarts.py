"""Restarts: a state directory counts the times its node's process started again after one that did not stop cleanly
(killed, crashed) or because a round stalled past swarm.stall_restart_s, and a node whose round stays stalled starts
its own process again: the same command and PID, its children gone, the state directory's lock taken anew."""

from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import os
import subprocess
import sys
import threading

import pytest

from node.config import dump_config
from node.state import RUNS_FILE, Runs, read_runs, record_start, record_stop
from node.stats import RoundProgress, SwarmStats, prometheus_text, stall_restart_due
from tests.helpers.common import CLI_TIMEOUT_S, REPO, cli, reporting_child
from tests.helpers.rollouts import hanging_node
from tests.helpers.swarm import SwarmProcess, read_rows, wait_for, wait_for_async


def test_a_start_after_an_unclean_end_or_a_stall_is_a_restart_and_a_users_stop_is_not(tmp_path, caplog):
    first = record_start(tmp_path)
    assert (first.starts, first.restarts, first.running) == (1, 0, True)
    record_stop(tmp_path, first)  # a clean stop: the user's
    again = record_start(tmp_path)
    assert (again.starts, again.restarts) == (2, 0)
    # no record_stop: that process was killed
    after_kill = record_start(tmp_path)
    assert (after_kill.starts, after_kill.after_unclean_end, after_kill.restarts) == (3, 1, 1)
    record_stop(tmp_path, after_kill, stalled_round=7)
    after_stall = record_start(tmp_path)
    assert (after_stall.after_unclean_end, after_stall.stall_restarts, after_stall.stall_round) == (1, 1, 7)
    assert after_stall.restarts == 2
    assert read_runs(tmp_path) == after_stall

    (tmp_path / RUNS_FILE).write_text('{"starts": "many"')  # cut short
    with caplog.at_level(logging.WARNING, logger="node.state"):
        assert read_runs(tmp_path) == Runs()
    assert "is damaged" in caplog.text and "counting this state directory's restarts from now" in caplog.text
    assert record_start(tmp_path).starts == 1  # a bad file stops nothing
    for wrong in ('{"starts": "many"}', '{"starts": 2, "running": "yes"}', "[1, 2]", '{"stall_round": 1.5}'):
        (tmp_path / RUNS_FILE).write_text(wrong)
        assert read_runs(tmp_path) == Runs(), wrong
        assert record_start(tmp_path).starts == 1, wrong


def test_restarts_are_counted_in_prometheus_and_the_totals():
    stats = SwarmStats("me")
    stats.restarts = 3
    assert stats.totals()["restarts"] == 3
    assert "swarm_node_restarts_total 3" in prometheus_text({}, stats)


def test_a_round_is_due_a_restart_only_once_stalled_that_long_past_its_bound():
    now = [0.0]
    progress = RoundProgress(2.0, 10.0, clock=lambda: now[0])
    progress.services_up()
    progress.round_done(1, 1.0)
    now[0] = 15.0  # stalled (bound 10 s), 5 s past it
    assert progress.report()["status"] == "stalled"
    assert not stall_restart_due(progress.report(), 30.0)
    assert not stall_restart_due(progress.report(), None)
    now[0] = 40.0
    assert stall_restart_due(progress.report(), 30.0)
    progress.stopping = True  # a node on its way out is not restarted
    assert not stall_restart_due(progress.report(), 30.0)


RESTARTING = """
import json, multiprocessing, os, subprocess, sys, threading, time
from pathlib import Path
import psutil
from node.runtime import restart_process
from node.state import lock_state_dir, record_start, record_stop

state = Path(sys.argv[1])
lock_state_dir(state)
runs = record_start(state)
if runs.stall_restarts == 0:
    sleeper = subprocess.Popen(["sleep", "600"])  # a child as the p2p daemon is
    forked = multiprocessing.get_context("fork").Process(target=time.sleep, args=(600,))  # as the DHT's process is
    forked.start()  # it holds the lock's file description too
    (state / "children").write_text(f"{sleeper.pid} {forked.pid}")
    threading.Thread(target=threading.Event().wait).start()  # a thread that never returns, as a hung one
    record_stop(state, runs, stalled_round=3)
    restart_process()
alive = [pid for pid in map(int, (state / "children").read_text().split()) if psutil.pid_exists(pid)]
print(json.dumps({"pid": os.getpid(), "alive": alive, "argv": sys.argv[1:], "restarts": runs.restarts}), flush=True)
sys.stdin.read()
"""


def test_a_process_restarting_itself_ends_its_children_and_threads_and_takes_its_lock_again(tmp_path, cli_env):
    state = tmp_path / "state"
    script = tmp_path / "restarting.py"
    script.write_text(RESTARTING)
    argv = [sys.executable, str(script), str(state), "--fresh", "--keep"]
    with reporting_child(argv, cli_env, tmp_path / "err") as (proc, line):
        seen = json.loads(line)
        assert seen["pid"] == proc.pid  # the same process, a new image
        assert seen["alive"] == []
        assert seen["argv"] == [str(state), "--keep"]  # --fresh was for the first start only
        assert seen["restarts"] == 1
        fd = os.open(state / "lock", os.O_RDWR)
        try:
            with pytest.raises(BlockingIOError):  # the new image holds the lock itself
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)


def test_a_node_whose_round_stays_stalled_is_due_a_restart_once_per_round(tiny_config, caplog):
    """A real node, one round's generation blocked: the restart is due for that round once it has stayed stalled
    swarm.stall_restart_s past its bound; a round that already restarted the process is only reported."""
    from node.commands import stalled_round_to_restart

    hang_at_call = 2
    config = tiny_config("swarm.stall_min_s=1", "swarm.stall_factor=2", "swarm.stall_restart_s=1")
    node, hanging, release = hanging_node(config, hang_at_call)

    async def scenario():
        stop = asyncio.Event()
        run = asyncio.create_task(node.run(None, stop))
        try:
            await wait_for_async(hanging.is_set, 300, "the round that hangs")
            in_flight = node.round + 1
            restarted_on_it = asyncio.create_task(
                stalled_round_to_restart(node, Runs(stall_round=in_flight), 1.0, asyncio.Event(), poll_s=0.1)
            )
            await wait_for_async(lambda: "stalled again after the process restarted" in caplog.text, 300, "the note")
            assert not restarted_on_it.done()
            restarted_on_it.cancel()
            stopping = asyncio.Event()
            stopping.set()  # a node asked to stop does not start again
            asked_to_stop = asyncio.create_task(stalled_round_to_restart(node, Runs(), 1.0, stopping, poll_s=0.1))
            round_, reason = await asyncio.wait_for(
                stalled_round_to_restart(node, Runs(), 1.0, asyncio.Event(), poll_s=0.1), 300
            )
            assert not asked_to_stop.done()
            asked_to_stop.cancel()
            assert node.round + 1 == in_flight  # still in flight
            return round_, reason, in_flight
        finally:
            release.set()
            stop.set()
            await run

    with caplog.at_level(logging.WARNING, logger="node"):
        round_, reason, in_flight = asyncio.run(scenario())
    assert round_ == in_flight
    assert reason.startswith("no round completed for ") and ", generating for " in reason


@pytest.mark.integration
def test_a_node_killed_counts_a_restart_at_its_next_start_and_a_stop_does_not(tiny_config, tmp_path, cli_env, nodes):
    path = tmp_path / "tiny.yaml"
    path.write_text(dump_config(tiny_config()))
    state = tmp_path / "node"
    node = SwarmProcess(path, state, cli_env, command="train")
    nodes.append(node)
    wait_for(lambda: node.assert_running() or len(read_rows(state)) >= 1, 120, "a round")
    node.kill()  # SIGKILL
    assert read_runs(state).running  # what the killed process left

    def train_one() -> subprocess.CompletedProcess:
        args = cli("train", "--config", str(path), "--state-dir", str(state), "--rounds", "1")
        return subprocess.run(args, capture_output=True, text=True, env=cli_env, cwd=REPO, timeout=CLI_TIMEOUT_S)

    after_kill = train_one()
    assert after_kill.returncode == 0, after_kill.stderr
    runs = read_runs(state)
    assert (runs.starts, runs.after_unclean_end, runs.running) == (2, 1, False)
    assert (
        "start 2 of this state directory: 1 after a process that did not stop cleanly"
        in (state / "node.log").read_text()
    )
    assert train_one().returncode == 0
    assert read_runs(state).restarts == 1  # that clean stop was no restart


def test_a_blocked_event_loop_is_found_by_a_thread_of_its_own():
    """A call that blocks the event loop stops every task on it, the round watchdog's too: the loop watchdog's thread
    still sees it, once, and a loop that turns is never called hung."""
    from node.runtime import LoopWatchdog

    hangs: list[float] = []
    found = threading.Event()

    def on_hang(blocked_s: float) -> None:
        hangs.append(blocked_s)
        found.set()

    async def scenario() -> None:
        watchdog = LoopWatchdog(10.0, on_hang, tick_s=0.05)  # far past what a loaded machine delays a loop by
        watchdog.start()
        try:
            for _ in range(10):  # a loop that turns
                await asyncio.sleep(0.05)
            assert not hangs
            assert found.wait(CLI_TIMEOUT_S)  # blocks the loop (a blocking call on it) until the thread saw it
        finally:
            watchdog.stop()

    asyncio.run(scenario())
    assert len(hangs) == 1 and hangs[0] >= 10.0
