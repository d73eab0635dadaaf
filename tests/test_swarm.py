"""Real swarm nodes on 127.0.0.1: joining, SAPO sharing, peers listing, churn."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from benchmarks.soak.plan import LIBFAKETIME
from node.config import load_config
from tests.helpers.common import CLI_TIMEOUT_S, REPO, cli
from tests.helpers.swarm import SWARM_OVERRIDES, SwarmProcess, daemon_of, peers_listed, read_rows, wait_for

pytestmark = pytest.mark.integration

AHEAD_S = 120
CLOCK_SAID = r"this node's clock looks (\d+) s ahead of the swarm's.*"


def uses_peers(state_dir) -> bool:
    return any(row.get("external_questions", 0) > 0 for row in read_rows(state_dir))


def peers_json(env, address: str) -> list[dict]:
    return peers_listed(address, "test-swarm", env, must_succeed=True)


def wait_for_peers(env, address: str, count: int) -> list[dict]:
    def listed():
        peers = peers_json(env, address)
        return peers if len(peers) == count else None

    return wait_for(listed, 60, f"{count} live peers", interval=1)


def test_three_nodes_train_on_each_others_rollouts(swarm_yaml, tmp_path, cli_env, nodes):
    first = SwarmProcess(swarm_yaml, tmp_path / "a", cli_env)
    nodes.append(first)
    bootstrap = first.addresses()
    nodes += [SwarmProcess(swarm_yaml, tmp_path / name, cli_env, bootstrap) for name in ("b", "c")]
    for node in nodes:
        wait_for(
            lambda: node.assert_running() or uses_peers(node.state_dir),
            180,
            f"{node.state_dir.name} to train on peers' rollouts",
        )

    listed = wait_for_peers(cli_env, bootstrap[0], 3)
    for peer in listed:
        assert {"node_id", "round", "reward_mean", "last_seen"} <= set(peer)
        assert peer["round"] > 0 and peer["rollouts_published"] > 0
    ids = {
        json.loads(
            subprocess.run(
                cli("identity", "--state-dir", str(n.state_dir), "--json"),
                capture_output=True,
                text=True,
                env=cli_env,
                cwd=REPO,
                timeout=CLI_TIMEOUT_S,
            ).stdout
        )["node_id"]
        for n in nodes
    }
    assert {peer["node_id"] for peer in listed} == ids

    for node in nodes:
        assert node.interrupt() == 0, node.output()
    for node in nodes:
        swarm = json.loads((node.state_dir / "swarm.json").read_text())
        used = {
            peer: counters["questions_used"] for peer, counters in swarm["peers"].items() if counters["questions_used"]
        }
        assert used, f"{node.state_dir.name} used no peer questions"
        assert swarm["totals"]["rejected"] == {}  # honest peers: nothing refused
        assert swarm["totals"]["gossip_messages_received"] > 0  # pushed over libp2p gossipsub, not only polled
        stats = subprocess.run(
            cli("stats", "--state-dir", str(node.state_dir), "--json"),
            capture_output=True,
            text=True,
            env=cli_env,
            cwd=REPO,
            timeout=CLI_TIMEOUT_S,
        )
        assert json.loads(stats.stdout)["swarm"]["totals"]["batches_accepted"] > 0


def test_kill_9_one_node_others_continue_and_it_rejoins(swarm_yaml, tmp_path, cli_env, nodes):
    first = SwarmProcess(swarm_yaml, tmp_path / "a", cli_env)
    nodes.append(first)
    bootstrap = first.addresses()
    second = SwarmProcess(swarm_yaml, tmp_path / "b", cli_env, bootstrap)
    nodes.append(second)
    wait_for(lambda: second.assert_running() or uses_peers(second.state_dir), 180, "b to use a's rollouts")
    wait_for(lambda: uses_peers(first.state_dir), 180, "a to use b's rollouts")

    # A row is written before its round's checkpoint: kill only once a checkpoint exists, or the node rightly starts
    # fresh.
    wait_for(lambda: (second.state_dir / "checkpoints" / "LATEST").exists(), 180, "b's first checkpoint")
    second.kill()
    rounds_at_kill = read_rows(second.state_dir)[-1]["round"]
    first_rounds = read_rows(first.state_dir)[-1]["round"]
    wait_for(
        lambda: first.assert_running() or read_rows(first.state_dir)[-1]["round"] > first_rounds + 5,
        60,
        "a to keep training alone",
    )

    restarted = SwarmProcess(swarm_yaml, tmp_path / "b", cli_env, bootstrap)
    nodes.append(restarted)
    marker = len(read_rows(restarted.state_dir))
    wait_for(
        lambda: (
            restarted.assert_running()
            or any(r.get("external_questions", 0) > 0 for r in read_rows(restarted.state_dir)[marker:])
        ),
        180,
        "the restarted node to use a's rollouts again",
    )
    rows = read_rows(restarted.state_dir)
    assert rows[0]["round"] == 1 and [r["round"] for r in rows] == list(range(1, rows[-1]["round"] + 1))
    assert rows[-1]["round"] > rounds_at_kill - 1  # resumed, not restarted from scratch
    assert "resuming at round" in restarted.output()
    assert len({peer["node_id"] for peer in wait_for_peers(cli_env, bootstrap[0], 2)}) == 2


def used_from(state_dir, peer_id: str) -> int:
    """Questions of that node's a node trained on, from its swarm.json."""
    path = state_dir / "swarm.json"
    peers = json.loads(path.read_text())["peers"] if path.exists() else {}
    return peers.get(peer_id, {}).get("questions_used", 0)


@pytest.mark.parametrize(
    "fault, noticed",
    [
        ("SIGKILL", "the p2p daemon exited (status -9)"),
        ("SIGSTOP", "the p2p daemon stopped answering (2 probes of 2 s in a row)"),  # alive, and answering nothing
    ],
)
def test_a_node_whose_p2p_daemon_dies_or_hangs_trains_on_and_rejoins_with_the_same_identity(
    fault, noticed, swarm_yaml, tmp_path, cli_env, nodes
):
    """kill -9 of a live node's p2pd (its DHT reads and writes go through it), or SIGSTOP (it neither exits nor
    answers): the node says so, trains on its own questions meanwhile, rejoins over a new daemon with the same peer id,
    and its peer trains on its rollouts again."""
    import os
    import signal
    import urllib.request

    from node.stats import HTTP_FILE, probe

    first = SwarmProcess(swarm_yaml, tmp_path / "a", cli_env)
    nodes.append(first)
    bootstrap = first.addresses()
    settings = ["--set", "swarm.metrics_port=0", "--set", "swarm.daemon_probe_s=2"]
    second = SwarmProcess(swarm_yaml, tmp_path / "b", cli_env, bootstrap, extra=settings)
    nodes.append(second)
    peer_id = second.addresses()[0].split("/p2p/")[1]
    b = identity_json(cli_env, second.state_dir)["node_id"]
    wait_for(lambda: first.assert_running() or used_from(first.state_dir, b) > 0, 180, "a to use b's rollouts")

    daemon = daemon_of(second)
    os.kill(daemon, getattr(signal, fault))
    log = second.state_dir / "node.log"
    try:
        wait_for(
            lambda: second.assert_running() or "rejoined the swarm as" in log.read_text(),
            180,
            "b to rejoin",
            interval=0.5,
        )
    finally:
        if fault == "SIGSTOP" and os.path.exists(f"/proc/{daemon}/cmdline"):
            os.kill(daemon, signal.SIGKILL)  # where the node did not: a stopped process outlives every SIGTERM
    text = log.read_text()
    assert f"lost the swarm connection ({noticed})" in text
    assert f"rejoined the swarm as {peer_id} " in text  # its p2p key, kept in the state directory
    assert daemon_of(second) != daemon  # a new daemon, under the same node process
    used_at_rejoin = used_from(first.state_dir, b)
    wait_for(
        lambda: first.assert_running() or used_from(first.state_dir, b) > used_at_rejoin,
        180,
        "a to use b's rollouts again",
    )
    rows = read_rows(second.state_dir)
    assert [r["round"] for r in rows] == list(range(1, rows[-1]["round"] + 1))  # not a round lost, none twice
    base = (second.state_dir / HTTP_FILE).read_text().strip()
    with urllib.request.urlopen(base + "/metrics", timeout=30) as response:
        metrics = response.read().decode()
    assert "swarm_node_swarm_connections_lost_total 1" in metrics and "swarm_node_swarm_rejoins_total 1" in metrics
    status, ready = probe(base + "/readyz", 30)
    assert ready["status"] in ("ready", "starting"), ready  # joined again (a stall floor of 120 s is far off)
    # and its heartbeat says so to whoever lists the swarm
    wait_for(
        lambda: any(p["node_id"] == b and p["rejoins"] == 1 for p in peers_json(cli_env, bootstrap[0])),
        120,
        "b's heartbeat to count its rejoin",
        interval=2,
    )
    # and it stops as a node that never lost its daemon does: the dead daemon's connection leaves nothing to print (a
    # soak saw "Task exception was never retrieved ... ConnectionResetError" at the stop of such a node)
    assert second.interrupt(timeout=CLI_TIMEOUT_S) == 0
    stopped = second.output()
    assert "saved round" in stopped and "Traceback" not in stopped and "never retrieved" not in stopped, stopped


def identity_json(env, state_dir) -> dict:
    result = subprocess.run(
        cli("identity", "--state-dir", str(state_dir), "--json"),
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=CLI_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_restarted_bootstrap_keeps_its_address_and_is_found_again(swarm_yaml, tmp_path, cli_env, nodes):
    """The first node of a swarm restarts on its fixed port: same /p2p/ id, and a node that knew only its old address
    meets it again."""
    first = SwarmProcess(swarm_yaml, tmp_path / "a", cli_env)
    nodes.append(first)
    bootstrap = first.addresses()
    ids = identity_json(cli_env, first.state_dir)
    assert all(a.endswith(f"/p2p/{ids['peer_id']}") for a in bootstrap)
    assert oct((first.state_dir / "p2p.key").stat().st_mode & 0o777) == "0o600"
    second = SwarmProcess(swarm_yaml, tmp_path / "b", cli_env, bootstrap)
    nodes.append(second)
    wait_for(lambda: first.assert_running() or uses_peers(first.state_dir), 180, "a to use b's rollouts")

    assert first.interrupt() == 0, first.output()
    (first.state_dir / "addresses.txt").unlink()
    port = bootstrap[0].split("/")[4]
    restarted = SwarmProcess(
        swarm_yaml, tmp_path / "a", cli_env, extra=["--set", f'swarm.host_maddrs=["/ip4/127.0.0.1/tcp/{port}"]']
    )
    nodes.append(restarted)
    assert restarted.addresses() == bootstrap  # the whole address, /p2p/ id included
    marker = len(read_rows(restarted.state_dir))
    wait_for(
        lambda: (
            restarted.assert_running()
            or second.assert_running()
            or any(r.get("external_questions", 0) > 0 for r in read_rows(restarted.state_dir)[marker:])
        ),
        180,
        "the restarted bootstrap to use b's rollouts again",
    )
    assert identity_json(cli_env, first.state_dir) == ids


def test_any_reachable_bootstrap_suffices(swarm_yaml, tmp_path, cli_env, nodes):
    dead = "/ip4/127.0.0.1/tcp/9/p2p/QmP3HDzGmujgBd5wAZF5yM4xgqC67RC8mSU7qRkCUgz8X5"
    first = SwarmProcess(swarm_yaml, tmp_path / "a", cli_env)
    nodes.append(first)
    second = SwarmProcess(swarm_yaml, tmp_path / "b", cli_env, [dead, *first.addresses()])
    nodes.append(second)
    wait_for(
        lambda: second.assert_running() or uses_peers(second.state_dir),
        180,
        "b, given one dead and one live bootstrap, to use a's rollouts",
    )


def test_dead_bootstrap_fails_with_a_clear_error(swarm_yaml, tmp_path, cli_env):
    dead = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWDsDVVqAytD5WL67JctokL1YTfxeg4M3REM7VPsSZNGJB"
    result = subprocess.run(
        cli(
            "join",
            "--config",
            str(swarm_yaml),
            "--state-dir",
            str(tmp_path / "x"),
            "--initial-peers",
            dead,
            "--set",
            "swarm.bootstrap_attempts=2",
            "--set",
            "swarm.p2pd_startup_timeout_s=10",
        ),
        capture_output=True,
        text=True,
        env=cli_env,
        cwd=REPO,
        timeout=CLI_TIMEOUT_S,
    )
    assert result.returncode == 1
    assert "could not join" in result.stderr and "after 2 attempts" in result.stderr
    assert f"{dead} (TCP connect failed" in result.stderr  # names each address tried and what failed there
    assert "Traceback" not in result.stderr

    listed = subprocess.run(
        cli("peers", "--initial-peers", dead, "--join-attempts", "2", "--json"),
        capture_output=True,
        text=True,
        env=cli_env,
        cwd=REPO,
        timeout=CLI_TIMEOUT_S,
    )
    assert listed.returncode == 1 and listed.stdout == ""  # an unreachable swarm is an error, never an empty list
    assert "could not join" in listed.stderr and "after 2 attempts" in listed.stderr
    assert "Traceback" not in listed.stderr


@pytest.mark.parametrize("gossip", ["dht", "libp2p"])
def test_both_gossip_channels_deliver_batches(gossip, model_cache, tmp_path):
    """In-process pair: the DHT-only fallback polls records; libp2p also pushes."""
    import asyncio

    from node.loop import Node

    def delivered(node) -> bool:
        totals = node.stats.totals()
        return totals["batches_accepted"] >= 2 and (gossip == "dht" or totals["gossip_messages_received"] > 0)

    async def scenario():
        pair = []
        try:
            for i in range(2):
                peers = [f"swarm.initial_peers={json.dumps(pair[0].addresses)}"] if pair else []
                node = Node(
                    load_config(
                        REPO / "configs" / "swarm.yaml",
                        [*SWARM_OVERRIDES, *peers, f"swarm.gossip={gossip}", f"seed={i}"],
                        state_dir=str(tmp_path / str(i)),
                    )
                )
                node.load()
                await node.start_services()
                pair.append(node)
            if gossip == "libp2p":
                await pair[0].transport.connect_gossip_peers()  # do not wait for the next heartbeat
                # a gossipsub heartbeat builds the meshes: nothing is pushed before (a hang guard, not a speed check)
                deadline = asyncio.get_running_loop().time() + 120
                while not all(node.transport.gossip.mesh_size(node.transport.rollouts_topic) for node in pair):
                    assert asyncio.get_running_loop().time() < deadline, "no gossipsub mesh within 120 s"
                    await asyncio.sleep(0.05)
            # a round takes only what arrived by then, so rounds go on until both took the other's batches (a hang
            # guard, not a speed check)
            deadline = asyncio.get_running_loop().time() + 300
            while not all(delivered(node) for node in pair):
                assert asyncio.get_running_loop().time() < deadline, [node.stats.totals() for node in pair]
                for node in pair:
                    await node.run_round()
            return [node.stats.totals() for node in pair]
        finally:
            for node in pair:
                await node.stop_services()

    totals = asyncio.run(scenario())
    assert all(t["batches_accepted"] >= 2 and t["rejected"] == {} for t in totals)
    if gossip == "dht":
        assert all(t["gossip_messages_received"] == 0 for t in totals)
    else:
        assert all(t["gossip_messages_received"] > 0 for t in totals)


faketime = pytest.mark.skipif(not LIBFAKETIME.exists(), reason=f"no {LIBFAKETIME} (make install puts it there)")


@faketime
def test_a_node_whose_clock_is_off_is_refused_at_join_and_told_why(swarm_yaml, tmp_path, cli_env, nodes):
    """hivemind's DHT refuses a bootstrap whose clocks differ by more than 3 s; a node must say it is its clock."""
    first = SwarmProcess(swarm_yaml, tmp_path / "a", cli_env)
    nodes.append(first)
    ahead = {**cli_env, "LD_PRELOAD": str(LIBFAKETIME), "FAKETIME": f"+{AHEAD_S}"}
    second = SwarmProcess(swarm_yaml, tmp_path / "b", ahead, first.addresses())
    nodes.append(second)
    second.process.wait(timeout=CLI_TIMEOUT_S)
    assert second.process.returncode == 1, second.output()
    assert (
        f"could not join the swarm after 5 attempts: this node's clock is {AHEAD_S} s ahead of its bootstrap peer's, "
        "and the DHT (hivemind) refuses a peer more than 3 s off; set the system clock right (timedatectl set-ntp true)"
    ) in " ".join(second.output().split()), second.output()


@faketime
def test_a_node_whose_clock_jumps_says_by_how_much_and_its_peer_sees_it(swarm_yaml, tmp_path, cli_env, nodes):
    """b's clock jumps 120 s ahead once it is joined (libfaketime, as a resumed VM's would): a's rollouts look 120 s
    old to it, past swarm.max_batch_age_s. It must say so, with the figure and the fix, in its log, its rows and
    /readyz, and a must see b's lead. A signed time arrives after it was signed, so b's figure is at least 120 s, and
    what a measures at most."""
    first = SwarmProcess(swarm_yaml, tmp_path / "a", cli_env)
    nodes.append(first)
    offset = tmp_path / "clock-offset"
    offset.write_text("+0\n")
    jumps = {
        **cli_env,
        "LD_PRELOAD": str(LIBFAKETIME),
        "FAKETIME_TIMESTAMP_FILE": str(offset),
        "FAKETIME_CACHE_DURATION": "1",
    }
    second = SwarmProcess(swarm_yaml, tmp_path / "b", jumps, first.addresses(), extra=["--set", "swarm.metrics_port=0"])
    nodes.append(second)
    wait_for(lambda: second.assert_running() or uses_peers(second.state_dir), 180, "b to use a's rollouts")
    log = second.state_dir / "node.log"
    assert not re.search(CLOCK_SAID, log.read_text())
    offset.write_text(f"+{AHEAD_S}\n")
    said = wait_for(
        lambda: second.assert_running() or re.search(CLOCK_SAID, log.read_text()), 180, "b to say its clock is ahead"
    )
    assert AHEAD_S - 1 <= int(said[1]) <= AHEAD_S + 60, said[0]
    assert "swarm.max_batch_age_s=120 s" in said[0] and "timedatectl set-ntp true" in said[0]
    rows = read_rows(second.state_dir)
    assert AHEAD_S - 1 <= rows[-1]["clock_offset_s"] <= AHEAD_S + 60, rows[-1]
    health = subprocess.run(
        cli("health", "--state-dir", str(second.state_dir)),
        env=cli_env,
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
    )
    assert "\nwarning: this node's clock looks" in health.stdout, health.stdout + health.stderr
    b = identity_json(cli_env, second.state_dir)["node_id"]

    def lead_of_b() -> float | None:
        path = first.state_dir / "swarm.json"
        return json.loads(path.read_text()).get("clock_leads", {}).get(b) if path.exists() else None

    lead = wait_for(
        lambda: first.assert_running() or ((x := lead_of_b()) is not None and x > 60 and x), 120, "a to hear b's lead"
    )
    assert lead <= AHEAD_S + 1, lead
