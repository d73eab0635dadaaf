"""Health: /healthz (the process answers), /readyz (joined, training, the last round within its bound) and
`swarm-node health`, which a container's healthcheck, a supervisor or a person runs."""

from __future__ import annotations

import asyncio
import json
import subprocess

import pytest

from node.stats import HTTP_FILE, MetricsServer, RoundProgress, probe
from tests.helpers.common import CLI_TIMEOUT_S, cli
from tests.helpers.rollouts import hanging_node
from tests.helpers.swarm import SwarmProcess, read_rows, wait_for, wait_for_async


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_readiness_follows_the_rounds_and_calls_a_round_ten_times_its_median_a_stall():
    clock = Clock()
    progress = RoundProgress(factor=10, min_s=30, clock=clock)
    assert progress.report()["status"] == "starting" and not progress.report()["ready"]
    progress.services_up()
    clock.now += 500  # a first round as long as it takes (a pretrained model's first generation) is no stall
    assert progress.report()["status"] == "starting"
    for round_ in range(1, 6):
        progress.round_done(round_, duration_s=[4, 5, 6, 5, 100][round_ - 1])
    report = progress.report()
    assert report["ready"] and report["status"] == "ready" and report["round"] == 5
    assert report["bound_s"] == 50  # 10 x the median 5 s, not the mean the 100 s round would pull up
    clock.now += 49
    assert progress.report()["ready"]
    clock.now += 2
    stalled = progress.report()
    assert not stalled["ready"] and stalled["status"] == "stalled"
    assert stalled["reason"] == "no round completed for 51 s (bound 50 s)"
    progress.round_done(6, duration_s=51)
    assert progress.report()["ready"]
    assert progress.report("the gossip service died")["status"] == "down"
    progress.stopping = True
    assert progress.report()["status"] == "stopping" and not progress.report()["ready"]


def test_the_bound_is_never_under_its_floor():
    clock = Clock()
    progress = RoundProgress(factor=10, min_s=30, clock=clock)
    progress.services_up()
    progress.round_done(1, duration_s=0.2)
    assert progress.report()["bound_s"] == 30
    clock.now += 29
    assert progress.report()["ready"]
    clock.now += 2
    assert progress.report()["status"] == "stalled"


def test_the_endpoints_answer_json_and_the_url_file_lives_as_long_as_the_server(tmp_path):
    verdict = {"ready": True, "status": "ready", "reason": "round 3 completed 1 s ago"}
    url_file = tmp_path / HTTP_FILE

    async def scenario():
        server = MetricsServer("127.0.0.1", 0, lambda: "x 1\n", readiness=lambda: dict(verdict), url_file=url_file)
        await server.start()
        try:
            base = url_file.read_text().strip()
            assert base == f"http://127.0.0.1:{server.port}"
            alive = await asyncio.to_thread(probe, base + "/healthz", 30)
            ready = await asyncio.to_thread(probe, base + "/readyz?verbose=1", 30)
            verdict.update(ready=False, status="stalled", reason="no round completed for 400 s (bound 120 s)")
            not_ready = await asyncio.to_thread(probe, base + "/readyz", 30)
            metrics = await asyncio.to_thread(probe, base + "/metrics", 30)
        finally:
            await server.stop()
        return alive, ready, not_ready, metrics

    alive, ready, not_ready, metrics = asyncio.run(scenario())
    assert alive[0] == 200 and alive[1]["alive"] is True and isinstance(alive[1]["pid"], int)
    assert ready == (200, verdict | {"ready": True, "status": "ready", "reason": "round 3 completed 1 s ago"})
    assert not_ready[0] == 503 and not_ready[1]["status"] == "stalled"
    assert metrics == (200, "not a health endpoint (HTTP 200, 4 bytes that are not JSON)")
    assert not url_file.exists()  # a stopped server leaves no URL another process's port could answer


def test_a_probe_of_nothing_says_why():
    import socket

    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    status, why = probe(f"http://127.0.0.1:{port}/readyz", 30)
    assert status is None and why == "Connection refused"


def test_a_node_whose_round_hangs_turns_stalled_and_ready_again(tiny_config, tmp_path, caplog):
    """A real node, its rollouts scripted so that one round's generation blocks: /readyz over HTTP says stalled while
    it blocks and ready once the round completes; the watchdog logs the stall once, with the part the round is in and
    where each thread is."""
    hang_at_call = 3
    config = tiny_config("swarm.metrics_port=0", "swarm.stall_min_s=2", "swarm.stall_factor=2")
    node, hanging, release = hanging_node(config, hang_at_call)

    async def scenario():
        stop = asyncio.Event()
        run = asyncio.create_task(node.run(None, stop))
        try:
            await wait_for_async(lambda: (node.store.root / HTTP_FILE).exists(), 120, "the URL file")
            base = (node.store.root / HTTP_FILE).read_text().strip()
            seen = []

            async def readyz_status():
                status, body = await asyncio.to_thread(probe, base + "/readyz", 30)
                seen.append((status, body["status"]))
                return body["status"]

            await wait_for_async(hanging.is_set, 300, "the round that hangs")
            await wait_for_async_value(readyz_status, "stalled", 300)
            assert node.round == hang_at_call  # the hanging round is still in flight
            await wait_for_async(lambda: node.stats.stalls == 1, 300, "the watchdog to report the stall")
            release.set()
            await wait_for_async_value(readyz_status, "ready", 300)
            assert node.round > hang_at_call
            return seen
        finally:
            release.set()
            stop.set()
            await run

    with caplog.at_level("WARNING", logger="node.loop"):
        seen = asyncio.run(scenario())
    assert (503, "stalled") in seen and seen[-1] == (200, "ready")
    [stall] = [r.getMessage() for r in caplog.records if "stalled" in r.getMessage()]
    assert stall.startswith(f"round {hang_at_call + 1} stalled: no round completed for ")
    assert ", generating for " in stall and "release.wait(CLI_TIMEOUT_S)" in stall  # the line the thread waits on
    assert not (node.store.root / HTTP_FILE).exists()


async def wait_for_async_value(read, wanted: str, timeout: float) -> None:
    """Poll `read()` until it returns `wanted` (a wait on the state itself, bounded only as a hang guard)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while (value := await read()) != wanted:
        assert asyncio.get_running_loop().time() < deadline, f"readiness still {value!r}, never {wanted!r}"
        await asyncio.sleep(0.2)


def health(cli_env, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        cli("health", *args), env=cli_env, capture_output=True, text=True, timeout=CLI_TIMEOUT_S, check=False
    )


@pytest.mark.integration
def test_the_health_command_answers_with_an_exit_code(tiny_config, tmp_path, cli_env, nodes):
    from node.config import dump_config

    path = tmp_path / "tiny.yaml"
    path.write_text(dump_config(tiny_config("swarm.metrics_port=0")))
    state = tmp_path / "node"
    never_ran = health(cli_env, "--state-dir", str(state))
    assert never_ran.returncode == 1 and never_ran.stdout.startswith(f"not running: no {state / HTTP_FILE}")
    node = SwarmProcess(path, state, cli_env, command="train")
    nodes.append(node)
    wait_for(lambda: node.assert_running() or len(read_rows(state)) >= 2, CLI_TIMEOUT_S, "two rounds")
    live = health(cli_env, "--state-dir", str(state), "--live")
    assert live.returncode == 0 and live.stdout.startswith("alive: pid "), live.stdout + live.stderr
    answer = health(cli_env, "--state-dir", str(state), "--json")
    body = json.loads(answer.stdout)
    # the rounds of a tiny model take well under the 120 s floor, however loaded the machine
    assert answer.returncode == 0 and body["ready"] is True and body["http_status"] == 200, answer.stdout
    assert body["url"] == (state / HTTP_FILE).read_text().strip() + "/readyz"
    line = health(cli_env, "--url", body["url"].removesuffix("/readyz"))
    assert line.returncode == 0 and line.stdout.startswith("ready (ready): round "), line.stdout
    node.interrupt()
    gone = health(cli_env, "--url", body["url"].removesuffix("/readyz"))
    assert gone.returncode == 1 and gone.stdout.startswith("unreachable: "), gone.stdout
    assert health(cli_env, "--state-dir", str(state)).stdout.startswith("not running: ")


@pytest.mark.integration
@pytest.mark.parametrize("flag", ["--live", "--json"])
def test_the_health_command_says_unreachable_where_nothing_answers(flag, cli_env):
    answer = health(cli_env, "--url", "http://127.0.0.1:9", flag)  # the discard port: nothing listens there
    assert answer.returncode == 1
    if flag == "--json":
        assert json.loads(answer.stdout)["http_status"] is None
    else:
        assert answer.stdout.startswith("unreachable: http://127.0.0.1:9/healthz: ")


def systemd_messages(sock, until, timeout: float = CLI_TIMEOUT_S) -> list[str]:
    """The datagrams a notifier sent to `sock` (systemd's notify socket, played by the test) until `until(messages)`."""
    messages: list[str] = []
    sock.settimeout(timeout)
    while not until(messages):
        messages.append(sock.recv(4096).decode())
    return messages


def test_under_systemd_the_watchdog_is_fed_only_while_the_node_is_not_stalled(tmp_path, monkeypatch):
    import socket

    from node.runtime import start_systemd_notifier

    path = tmp_path / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as systemd:
        systemd.bind(str(path))
        monkeypatch.setenv("NOTIFY_SOCKET", str(path))
        monkeypatch.setenv("WATCHDOG_USEC", "20000")  # a ping every 10 ms
        monkeypatch.delenv("WATCHDOG_PID", raising=False)
        verdict = {"ready": False, "status": "starting", "reason": "loading the policy and joining"}
        counts = []

        async def scenario():
            task = start_systemd_notifier(lambda: dict(verdict))
            try:
                for status, ready in (("starting", False), ("ready", True), ("stalled", False), ("ready", True)):
                    verdict.update(status=status, ready=ready, reason=status)
                    got = await asyncio.to_thread(
                        systemd_messages,
                        systemd,
                        lambda m, status=status: sum(line.startswith(f"STATUS={status}") for line in m) >= 3,
                    )
                    counts.append((status, got))
            finally:
                task.cancel()

        asyncio.run(scenario())
    phases = {}
    for status, messages in counts:
        mine = [m for m in messages if m.startswith(f"STATUS={status}")]
        phases.setdefault(status, []).append(mine)
    assert all("WATCHDOG=1" in m for m in phases["starting"][0])  # loading is not a hang
    assert "STATUS=stalled: stalled" in phases["stalled"][0][0]
    assert not any("WATCHDOG=1" in m for m in phases["stalled"][0])  # systemd's timer runs out and it restarts it
    ready_once = [m for _, messages in counts for m in messages if "READY=1" in m]
    assert len(ready_once) == 1 and ready_once[0].startswith("STATUS=ready")


@pytest.mark.integration
def test_a_node_under_systemd_says_ready_and_feeds_its_watchdog(tiny_config, tmp_path, cli_env, nodes):
    import socket

    from node.config import dump_config

    path = tmp_path / "tiny.yaml"
    path.write_text(dump_config(tiny_config()))  # no metrics port: the notifier needs none
    notify = tmp_path / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as systemd:
        systemd.bind(str(notify))
        env = dict(cli_env, NOTIFY_SOCKET=str(notify), WATCHDOG_USEC="1000000")
        node = SwarmProcess(path, tmp_path / "node", env, command="train")
        nodes.append(node)
        messages = systemd_messages(systemd, lambda m: any("READY=1" in line for line in m))
        ready = next(line for line in messages if "READY=1" in line)
        assert ready.startswith("STATUS=ready: round ") and "WATCHDOG=1" in ready
        assert node.interrupt() == 0
        after = systemd_messages(systemd, lambda m: any("STOPPING=1" in line for line in m), timeout=5)
        assert after  # a unit that is stopping says so, and stops feeding its watchdog


def test_a_node_rejoining_its_swarm_is_not_ready_and_says_why(tiny_config):
    from node.loop import Node

    node = Node(tiny_config())
    node.progress.services_up()
    node.progress.round_done(1, 0.5)
    assert node.readiness()["status"] == "ready"
    node.swarm_lost = "the p2p daemon exited (status -9)"  # what Node.keep_joined records while it rejoins
    report = node.readiness()
    assert report["status"] == "down" and not report["ready"]
    assert report["reason"] == (
        "rejoining the swarm (training on its own questions meanwhile): the p2p daemon exited (status -9)"
    )
