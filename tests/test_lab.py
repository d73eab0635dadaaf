"""The swarm lab (benchmarks/lab/): namespaces on a bridge, shaped links, partitions, cleanup after a
crash, and a short swarm in it with loss and a node killed with -9 (the long fault runs are `slow`)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from benchmarks.lab import (
    REGISTRY_DIR,
    Lab,
    Link,
    cleanup_stale,
    lab_unavailable,
    node_argv,
    node_summary,
    start_swarm,
)
from tests.helpers.common import CLI_TIMEOUT_S, REPO, TINY_OVERRIDES, cli
from tests.helpers.swarm import read_rows, wait_for

needs_lab = pytest.mark.skipif(lab_unavailable() is not None, reason=str(lab_unavailable()))

SINK = textwrap.dedent("""
    import socket, sys
    server = socket.create_server((sys.argv[1], int(sys.argv[2])))
    while True:
        conn, _ = server.accept()
        total = 0
        while chunk := conn.recv(65536):
            total += len(chunk)
        conn.sendall(str(total).encode())
        conn.close()
""")
SEND = textwrap.dedent("""
    import socket, sys, time
    started = time.monotonic()
    conn = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[4]))
    conn.sendall(bytes(int(sys.argv[3])))
    conn.shutdown(socket.SHUT_WR)
    received = int(conn.recv(64))
    print(received, time.monotonic() - started)
""")


def send(lab: Lab, source: int, target: int, nbytes: int, connect_timeout: float = 5.0) -> tuple[int, float] | None:
    """Bytes the sink on `target` counted and the seconds it took, or None when no connection could be made."""
    result = subprocess.run(
        [
            "ip",
            "netns",
            "exec",
            lab.ns(source),
            sys.executable,
            "-c",
            SEND,
            lab.ip(target),
            "9000",
            str(nbytes),
            str(connect_timeout),
        ],
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
    )
    if result.returncode != 0:
        return None
    received, seconds = result.stdout.split()
    return int(received), float(seconds)


def test_the_lab_runs_its_processes_from_the_repository():
    """A process the lab starts runs in the repository (the packages it imports by `-m`, the configs by path): the
    lab became a package one level deeper and for a while pointed at benchmarks/ instead."""
    from benchmarks.lab import REPO

    assert (REPO / "pyproject.toml").exists() and (REPO / "benchmarks" / "lab" / "__init__.py").exists()


def test_link_profiles_are_checked():
    assert Link(mbit=50).up == 50 and Link(mbit=50, up_mbit=5).up == 5 and Link(mbit=50, up_mbit=5).down == 50
    for bad in (dict(mbit=0), dict(loss=1.0), dict(loss=-0.1), dict(up_mbit=1e9)):
        with pytest.raises(ValueError):
            Link(**bad)
    with pytest.raises(ValueError):
        Lab(0)
    with pytest.raises(ValueError):
        Lab(2, tag="much-too-long")


@pytest.mark.integration
@needs_lab
def test_a_second_lab_joined_to_the_host_is_refused_while_the_first_lives():
    """Two labs with host_link share HOST_IP and its route: the second would silently take the first's traffic. A
    live lab that holds the host link (here a registry record owned by a live process) makes up() refuse, creating
    nothing."""
    owner = subprocess.Popen(["sleep", "60"])
    record = REGISTRY_DIR / "slhold.json"
    REGISTRY_DIR.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps({"owner_pid": owner.pid, "tag": "slhold", "nodes": 1, "host_link": True}))
    try:
        lab = Lab(1, tag="slsecnd")
        with pytest.raises(RuntimeError, match="already joins this host"):  # slhold, or a live lab of its own
            lab.up()
        assert not (REGISTRY_DIR / "slsecnd.json").exists()
        assert "slsecnd-hub" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        Lab(1, tag="slother", host_link=False).__enter__().down()  # a lab without the host link is not in its way
    finally:
        owner.kill()
        owner.wait()
        record.unlink(missing_ok=True)


@pytest.mark.integration
@needs_lab
def test_shaped_links_partitions_and_teardown(tmp_path):
    with Lab(3, host_link=False) as lab:
        for index in range(3):
            lab.run(index, [sys.executable, "-c", SINK, lab.ip(index), "9000"], tmp_path / f"sink{index}.log")
        first = wait_for(lambda: send(lab, 0, 1, 1000), 60, "the sink on node 1 to listen")
        assert first[0] == 1000
        # 2 MB through node 0's upload at 8 Mbit/s cannot take less than ~2 s (a lower bound: load only adds to it)
        lab.shape(0, Link(up_mbit=8, down_mbit=100))
        received, seconds = send(lab, 0, 1, 2_000_000)
        assert received == 2_000_000 and seconds >= 1.6, seconds
        lab.shape(0, Link())  # unshaped again, and node 1's download at 8 Mbit/s is the bottleneck instead
        lab.shape(1, Link(down_mbit=8))
        received, seconds = send(lab, 0, 1, 2_000_000)
        assert received == 2_000_000 and seconds >= 1.6, seconds
        lab.shape(1, Link())
        lab.partition({2})
        assert send(lab, 0, 2, 1000, connect_timeout=3) is None  # cut off
        assert send(lab, 0, 1, 1000)[0] == 1000  # the rest still talk
        lab.heal()
        assert wait_for(lambda: send(lab, 0, 2, 1000), 60, "node 2 to be reachable after the heal")[0] == 1000
        namespaces = [lab.ns(i) for i in range(3)] + [lab.hub]
        pids = [p.popen.pid for p in lab.processes.values()]
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(ns in listed for ns in namespaces), listed
    assert not any(
        Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text() for pid in pids
    )


@pytest.mark.integration
@needs_lab
def test_a_lab_killed_with_sigkill_is_removed_by_the_next_one(tmp_path):
    script = textwrap.dedent(f"""
        import time
        from benchmarks.lab import Lab  # python -c puts its working directory, the repository, on the path
        lab = Lab(2, host_link=False)
        lab.up()
        lab.run(1, ["sleep", "1000"], __import__("pathlib").Path({str(tmp_path / 'sleep.log')!r}))
        print(lab.tag, lab.processes[1].popen.pid, flush=True)
        time.sleep(1000)
    """)
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        tag, sleeper = owner.stdout.readline().split()
        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=CLI_TIMEOUT_S)
        # left behind
        assert f"{tag}-n1" in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert tag in cleanup_stale()
        assert f"{tag}-" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        wait_for(
            lambda: not Path(f"/proc/{sleeper}").exists() or "zombie" in Path(f"/proc/{sleeper}/status").read_text(),
            30,
            "the orphaned process to be killed",
        )
    finally:
        if owner.poll() is None:
            owner.kill()


@pytest.mark.integration
@needs_lab
def test_a_swarm_in_the_lab_trains_through_loss_and_a_kill_9(model_cache, tmp_path, cli_env):
    """Short version of the lab's fault runs: 3 nodes, 20 Mbit/s links with 2 % loss each way; every node
    trains on its peers' rollouts; node 2 killed with -9 and restarted resumes its own state."""
    from node.config import load_config
    from node.model import ensure_default_model

    sets = [
        *TINY_OVERRIDES,
        "swarm.transport=dht",
        "swarm.swarm_id=lab-test",
        "swarm.window_s=2",
        "swarm.heartbeat_interval_s=1",
        "swarm.external_questions=2",
        "checkpoint_every=1",
        "torch_threads=1",
    ]
    # built once, before three nodes race to build it
    ensure_default_model(load_config(REPO / "configs" / "swarm.yaml", sets))
    with Lab(3, host_link=False) as lab:
        for index in range(3):
            lab.shape(index, Link(mbit=20, loss=0.02))
        bootstrap = start_swarm(lab, tmp_path, sets, env=cli_env, start_timeout_s=CLI_TIMEOUT_S)
        for index in range(3):
            wait_for(
                lambda: node_summary(tmp_path / f"n{index}")["external_questions"] > 0,
                300,
                f"node {index} to train on its peers' rollouts",
                interval=1,
            )
        before = wait_for(
            lambda: (
                read_rows(tmp_path / "n2")
                and (tmp_path / "n2" / "checkpoints" / "LATEST").exists()
                and read_rows(tmp_path / "n2")[-1]["round"]
            ),
            300,
            "node 2 to checkpoint",
            interval=1,
        )
        lab.kill(2)
        lab.restart(2, env=cli_env)
        wait_for(
            lambda: read_rows(tmp_path / "n2")[-1]["round"] > before + 1,
            300,
            "node 2 to resume and train on",
            interval=1,
        )
        rounds = [r["round"] for r in read_rows(tmp_path / "n2")]
        # resumed: no round counted twice, none restarted from 1
        assert rounds == sorted(set(rounds)) and rounds[0] == 1

        last: list[str] = []

        def listed() -> set[str]:
            result = subprocess.run(
                [
                    "ip",
                    "netns",
                    "exec",
                    lab.ns(0),
                    *cli("peers", "--initial-peers", bootstrap, "--swarm-id", "lab-test", "--json"),
                ],
                capture_output=True,
                text=True,
                env=cli_env,
                cwd=REPO,
                timeout=CLI_TIMEOUT_S,
            )
            last[:] = [f"exit {result.returncode}", result.stdout[-2000:], result.stderr[-2000:]]
            return {row["display_name"] for row in json.loads(result.stdout)} if result.returncode == 0 else set()

        try:
            wait_for(lambda: listed() == {"lab-0", "lab-1", "lab-2"}, 120, "peers to list all three nodes", interval=2)
        except AssertionError as failure:
            raise AssertionError(f"{failure}; last `peers` call: {last}; node logs under {tmp_path}") from None
        assert all(lab.alive(i) for i in range(3))  # the lab's exit stops them and removes the namespaces


@pytest.mark.integration
@needs_lab
def test_a_dead_bootstrap_peer_in_the_lab_gives_the_clear_error_after_its_retries(model_cache, tmp_path, cli_env):
    with Lab(2, host_link=False) as lab:  # node 1's address: nobody listens there
        dead = "/ip4/198.18.1.2/tcp/31337/p2p/12D3KooWDsDVVqAytD5WL67JctokL1YTfxeg4M3REM7VPsSZNGJB"
        argv = node_argv(
            lab,
            0,
            tmp_path / "n0",
            dead,
            [*TINY_OVERRIDES, "swarm.transport=dht", "swarm.bootstrap_attempts=2", "swarm.p2pd_startup_timeout_s=10"],
            fresh=True,
        )
        process = lab.run(0, argv, tmp_path / "n0.out", cli_env)
        assert process.wait(timeout=CLI_TIMEOUT_S) == 1
        out = (tmp_path / "n0.out").read_text()
        assert "could not join" in out and "after 2 attempts" in out, out[-2000:]
        assert "Traceback" not in out


@pytest.mark.integration
@needs_lab
def test_noloco_pairs_form_between_namespaces(tmp_path):
    """Four averaging peers, each in its own namespace: every one must find a partner every round. A
    random partner on another host is often not connected to us yet, and p2pd finds no route to a
    bare peer id; before announcements carried their daemon's addresses, half the peers of every
    round failed here ("routing: not found"), while every loopback test passed. A long settle time
    keeps a slow machine from ending a round early: only a failed exchange can fail this test."""
    result = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "averaging_sync.py"),
            "--lab",
            "--sizes",
            "4",
            "--rounds",
            "2",
            "--floats",
            "1000",
            "--methods",
            "noloco",
            "--mbit",
            "100",
            "--settle-s",
            "60",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=CLI_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["complete"]["noloco"]["4"] == "8/8", result.stdout[-3000:]
