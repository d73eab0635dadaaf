"""Every command stops on the first Ctrl-C or SIGTERM within a bounded time, a second one leaves at once, and a stop
prints no traceback: a pipeline driver waiting for a stage that never comes, a training node still building its
policy, a swarm node whose p2p daemon no longer shares its process group (so a terminal's Ctrl-C reaches the node
alone, and the node stops the daemon after it has saved). Every wait below is a hang guard, never a speed check."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.common import CLI_TIMEOUT_S, REPO, cli
from tests.helpers.swarm import SwarmProcess, read_rows, wait_for

pytestmark = pytest.mark.integration

STOPPED_S = 120  # x WAIT_SCALE: a hang guard for a stop that must not wait on anything unbounded


def children(pid: int) -> list[int]:
    """The processes `pid` started that still run (Linux)."""
    tasks = Path(f"/proc/{pid}/task")
    return [int(c) for task in tasks.iterdir() for c in (task / "children").read_text().split()]


def gone(pid: int) -> bool:
    """Whether `pid` has exited (a zombie nobody reaped counts as exited)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")
    except FileNotFoundError:
        return True


# the second signal, on the command runtime alone: work in flight that never ends (a round, a model still loading)
SECOND_SIGNAL = """
import asyncio, threading
from node.runtime import on_stop_signals

async def main():
    on_stop_signals(lambda: print("first", flush=True), on_second=lambda: print("second", flush=True))
    await asyncio.to_thread(threading.Event().wait)  # a worker thread that never returns

asyncio.run(main())
"""


def test_a_second_signal_leaves_at_once_while_a_worker_thread_still_runs(cli_env):
    process = subprocess.Popen(
        [sys.executable, "-c", SECOND_SIGNAL],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=cli_env,
        cwd=REPO,
    )
    try:
        os.kill(process.pid, signal.SIGTERM)  # may come before the handlers: then it ends the process, as it should
        first = process.stdout.readline()
        if first == "first\n":
            os.kill(process.pid, signal.SIGINT)
            assert process.stdout.readline() == "second\n"
            assert process.wait(timeout=STOPPED_S) == 130
            assert process.stderr.read() == ""
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=60)
        process.stdout.close()
        process.stderr.close()


def test_a_stop_while_the_policy_still_builds_leaves_at_once(tiny_config, tmp_path, cli_env):
    """A first run warm-starts the default model (minutes on a small machine); a stop then has nothing to save."""
    from node.config import dump_config

    path = tmp_path / "slow.yaml"
    path.write_text(dump_config(tiny_config("model.default.warmup_steps=1000000")))
    state = tmp_path / "state"
    env = dict(cli_env, SWARM_NODE_CACHE=str(tmp_path / "empty-cache"))  # nothing built yet
    with open(tmp_path / "train.out", "w") as out:
        process = subprocess.Popen(
            cli("train", "--config", str(path), "--state-dir", str(state)),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=REPO,
            start_new_session=True,
        )
    try:
        log = state / "node.log"
        wait_for(
            lambda: process.poll() is None and log.exists() and "building the default model" in log.read_text(),
            STOPPED_S,
            "the warm start to begin",
        )
        os.kill(process.pid, signal.SIGTERM)
        assert process.wait(timeout=STOPPED_S * 3) == 0
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=60)
    output = (tmp_path / "train.out").read_text()
    assert "stopping: the policy is still loading, nothing to save yet" in output
    assert "Traceback" not in output and not (state / "checkpoints").exists()


def importing_torch(pid: int) -> bool:
    """Whether process `pid` has begun to load torch's libraries (its imports are under way, seconds from done)."""
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


@pytest.mark.parametrize("stop", ["SIGTERM", "Ctrl-C"])
def test_a_stop_during_the_imports_prints_no_traceback(stop, pipeline_yaml, tmp_path, cli_env):
    """A stage server stopped while it still imports torch and transformers (a soak stopped a spare it had just
    started): a KeyboardInterrupt inside an import leaves a module half made and the next import failed with a
    traceback (transformers' "Could not import module 'Qwen2ForCausalLM'"). It must stop, and say so in one line."""
    with open(tmp_path / "serve.out", "w") as out:
        process = subprocess.Popen(
            cli("serve", "--config", str(pipeline_yaml), "--state-dir", str(tmp_path / "state"), "--stage", "0"),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=cli_env,
            cwd=REPO,
            start_new_session=True,
        )
    try:
        wait_for(lambda: process.poll() is not None or importing_torch(process.pid), STOPPED_S, "torch to load")
        os.killpg(process.pid, signal.SIGINT if stop == "Ctrl-C" else signal.SIGTERM)
        code = process.wait(timeout=STOPPED_S)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=60)
    output = (tmp_path / "serve.out").read_text()
    assert code in (0, 130), output
    assert "Traceback" not in output, output


@pytest.mark.parametrize("stop", ["SIGTERM", "Ctrl-C"])
def test_a_driver_waiting_for_a_stage_that_never_comes_stops_on_the_first_signal(
    stop, pipeline_yaml, tmp_path, cli_env, procs
):
    """No stage is served at all: the driver's first step finds stage 0 lost and waits for it, for ever."""
    driver = SwarmProcess(pipeline_yaml, tmp_path / "driver", cli_env, command="drive")
    procs.append(driver)
    log = driver.state_dir / "node.log"  # whole lines (the console wraps them)
    wait_for(
        lambda: (
            driver.assert_running()
            or (log.exists() and "s for stage(s) 0, 1, 2, 3: no live server answers" in log.read_text())
        ),
        STOPPED_S,
        "the driver to wait for its stages",
        interval=0.5,
    )
    if stop == "SIGTERM":
        os.kill(driver.process.pid, signal.SIGTERM)
        code = driver.process.wait(timeout=STOPPED_S)
    else:
        code = driver.interrupt(timeout=STOPPED_S)  # to the process group, as a terminal sends it
    output = driver.output()
    assert code == 0, output
    assert "stopped at step 0" in output and "Traceback" not in output


def stopped(node: SwarmProcess, stop: str) -> tuple[int, str]:
    """Stop `node` the way `stop` names (SIGTERM, or a terminal's Ctrl-C): its exit status and what it printed."""
    if stop == "SIGTERM":
        os.kill(node.process.pid, signal.SIGTERM)
        code = node.process.wait(timeout=CLI_TIMEOUT_S)
    else:
        code = node.interrupt(timeout=CLI_TIMEOUT_S)
    return code, node.output()


@pytest.mark.parametrize("stop", ["SIGTERM", "Ctrl-C"])
def test_a_swarm_node_stops_its_daemon_after_saving_and_prints_no_traceback(stop, swarm_yaml, tmp_path, cli_env, nodes):
    node = SwarmProcess(swarm_yaml, tmp_path / "node", cli_env)
    nodes.append(node)
    node.addresses()
    wait_for(lambda: node.assert_running() or len(read_rows(node.state_dir)) >= 2, 120, "two rounds")
    (daemon,) = children(node.process.pid)
    assert os.getsid(daemon) == daemon  # p2pd leads a session of its own: no terminal's Ctrl-C reaches it
    code, output = stopped(node, stop)
    assert code == 0, output
    assert "saved round" in output
    for sign in ("Traceback", "Task exception was never retrieved", "DHT shutdown did not complete", "[ERROR]"):
        assert sign not in output, output
    assert gone(daemon)


@pytest.mark.parametrize("stop", ["SIGTERM", "Ctrl-C"])
def test_an_isolated_node_saves_on_the_first_signal_and_prints_no_traceback(
    stop, tiny_config, tmp_path, cli_env, nodes
):
    from node.config import dump_config

    path = tmp_path / "tiny.yaml"
    path.write_text(dump_config(tiny_config()))
    node = SwarmProcess(path, tmp_path / "node", cli_env, command="train")
    nodes.append(node)
    wait_for(lambda: node.assert_running() or len(read_rows(node.state_dir)) >= 2, 120, "two rounds")
    code, output = stopped(node, stop)
    assert code == 0, output
    assert "finishing the round in flight, then saving" in output and "saved round" in output
    assert "Traceback" not in output
