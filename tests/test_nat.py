"""Nodes behind home routers (benchmarks/lab/'s NAT: MASQUERADE out, only replies in) take full
part: rollouts both ways, NoLoCo pairing, two nodes behind two different NATs, and a stage server
behind NAT driven by a public driver that never had a connection to it (through the bootstrap
node's circuit relay). Each test first checks that the NAT is really there: a direct dial from a
public node to the NAT'd node's listening port fails, while the NAT'd node dials out.

And their relay restarting (`slow`): the public node that holds every NAT'd process's relay slot is
killed and started again (same key, same address), no NAT'd process is restarted, and each must
find its slot gone, get a new one and announce its /p2p-circuit address again, and then train on
peers' rollouts again, or (a driver and a stage server behind two different NATs, which reach each
other only through the relay) step through the pipeline again. Every wait is a hang guard on an
event; how long each part took is printed (run with -s), not asserted."""

from __future__ import annotations

import functools
import json
import time

import pytest

from node.config import dump_config, load_config
from protocol import NodeIdentity
from benchmarks.lab import Lab, lab_unavailable
from tests.helpers.common import REPO, TINY_OVERRIDES
from tests.helpers.pipeline import PIPELINE_OVERRIDES, assert_trains, recoveries
from tests.helpers.netlab import start_command
from tests.helpers.swarm import peers_listed, read_rows, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.skipif(lab_unavailable() is not None, reason=str(lab_unavailable()))]

SWARM_SETS = [
    *TINY_OVERRIDES,
    "swarm.transport=dht",
    "swarm.swarm_id=nat-test",
    "swarm.window_s=2",
    "swarm.heartbeat_interval_s=1",
    "swarm.heartbeat_ttl_s=15",
    "swarm.external_questions=2",
    "swarm.local_questions=2",
    "tasks.format_reward=0.1",
    "checkpoint_keep=1",
    "eval_every=0",
    "torch_threads=1",
]


def config_file(tmp_path, base: str, sets: list[str]):
    from node.model import ensure_default_model

    config = load_config(REPO / "configs" / base, sets)
    ensure_default_model(config, progress=False)  # built once, before several nodes race to build it
    path = tmp_path / "config.yaml"
    path.write_text(dump_config(config))
    return path


# every node of these tests is named nat-<index>
start = functools.partial(start_command, name="nat")


def port_of(maddr: str) -> int:
    return int(maddr.split("/")[4])


def assert_nat_in_place(lab: Lab, public: int, natted: int, natted_address: str, public_address: str) -> None:
    port = port_of(natted_address)
    assert lab.ip(natted) in natted_address
    assert not lab.dial(public, lab.ip(natted), port), "a public node reached the private address: no NAT"
    assert not lab.dial(public, lab.wan_ip(lab.nat[natted]), port), "the router forwards the port: no NAT"
    assert lab.dial(natted, lab.ip(public), port_of(public_address)), "the NAT'd node cannot dial out"


def node_id(tmp_path, index: int) -> str:
    return NodeIdentity.load_or_create(tmp_path / f"n{index}" / "identity.key").node_id


def questions_used(tmp_path, index: int) -> dict[str, int]:
    path = tmp_path / f"n{index}" / "swarm.json"
    try:
        peers = json.loads(path.read_text())["peers"]
    except (OSError, ValueError):
        return {}
    return {peer: counters["questions_used"] for peer, counters in peers.items() if counters["questions_used"]}


def wait_uses(lab: Lab, tmp_path, user: int, source: int) -> None:
    def used():
        assert lab.alive(user), (tmp_path / f"n{user}.out").read_text()[-3000:]
        return questions_used(tmp_path, user).get(node_id(tmp_path, source), 0) > 0

    wait_for(used, 300, f"node {user} to train on node {source}'s rollouts", interval=1)


def reachability_listed(lab: Lab, index: int, bootstrap: str, env) -> dict[str, str]:
    rows = peers_listed(bootstrap, "nat-test", env, netns=lab.ns(index))
    return {row["display_name"]: row["reachability"] for row in rows}


def test_a_node_behind_nat_and_two_public_nodes_use_each_others_rollouts(tmp_path, model_cache, cli_env):
    config = config_file(tmp_path, "swarm.yaml", SWARM_SETS)
    with Lab(3, host_link=False, nat={2: 0}) as lab:
        bootstrap = start(lab, 0, tmp_path, config, cli_env)
        public = start(lab, 1, tmp_path, config, cli_env, bootstrap=[bootstrap])
        natted = start(lab, 2, tmp_path, config, cli_env, bootstrap=[bootstrap])
        assert_nat_in_place(lab, 1, 2, natted, public)
        for user in range(3):
            for source in range(3):
                if user != source:
                    wait_uses(lab, tmp_path, user, source)
        listed = wait_for(
            lambda: (r := reachability_listed(lab, 1, bootstrap, cli_env)) and len(r) == 3 and r,
            60,
            "peers to list all three",
            interval=2,
        )
        assert listed["nat-0"] == listed["nat-1"] == "direct" and listed["nat-2"] == "relayed", listed
        assert "behind NAT" in (tmp_path / "n2" / "node.log").read_text()


def test_two_nodes_behind_two_different_nats_exchange_rollouts(tmp_path, model_cache, cli_env):
    """Neither can dial the other: rollouts go through the public node (gossipsub forwards, the DHT stores)."""
    config = config_file(tmp_path, "swarm.yaml", SWARM_SETS)
    with Lab(3, host_link=False, nat={1: 0, 2: 1}) as lab:
        bootstrap = start(lab, 0, tmp_path, config, cli_env)
        first = start(lab, 1, tmp_path, config, cli_env, bootstrap=[bootstrap])
        second = start(lab, 2, tmp_path, config, cli_env, bootstrap=[bootstrap])
        assert_nat_in_place(lab, 0, 1, first, bootstrap)
        assert_nat_in_place(lab, 0, 2, second, bootstrap)
        assert not lab.dial(1, lab.ip(2), port_of(second)) and not lab.dial(1, lab.wan_ip(1), port_of(second))
        wait_uses(lab, tmp_path, 1, 2)
        wait_uses(lab, tmp_path, 2, 1)


def test_a_node_behind_nat_pairs_with_a_public_node_for_noloco(tmp_path, model_cache, cli_env):
    """An exchange lasts at most its window (timeout_s <= window_s): with timeout_s=90 over 30 s windows a node that
    waited alone started its next exchange 3 windows on, so two nodes whose first ones fell in adjacent windows
    (the NAT'd node joins ~10 s later, more on a loaded machine) stayed a window apart for good (seen: 5
    exchanges in a row skipped, each a window off its partner's, in their metrics); node/averaging/service.py takes
    each exchange's round from the window it starts in."""
    sets = [
        *SWARM_SETS,
        "swarm.external_questions=0",
        "averaging.method=noloco",
        "averaging.every_steps=2",
        "averaging.window_s=60",
        "averaging.timeout_s=60",
    ]
    config = config_file(tmp_path, "swarm.yaml", sets)
    with Lab(2, host_link=False, nat={1: 0}) as lab:
        bootstrap = start(lab, 0, tmp_path, config, cli_env)
        natted = start(lab, 1, tmp_path, config, cli_env, bootstrap=[bootstrap])
        assert_nat_in_place(lab, 0, 1, natted, bootstrap)

        def averaged(index: int) -> bool:
            assert lab.alive(index), (tmp_path / f"n{index}.out").read_text()[-3000:]
            return any(
                isinstance(r.get("outer_step"), dict) and r["outer_step"].get("outcome") == "averaged"
                for r in read_rows(tmp_path / f"n{index}")
            )

        for index in range(2):
            wait_for(lambda: averaged(index), 300, f"node {index} to average with its partner", interval=1)


def test_a_public_driver_drives_a_stage_server_behind_nat(tmp_path, model_cache, cli_env):
    """The driver starts last, bootstrapped from the public stage 0 only: nothing but the relay and the stage
    announcement (its /p2p-circuit address) leads it to the NAT'd server of stage 1."""
    sets = [*PIPELINE_OVERRIDES, "pipeline.num_stages=2", "swarm.swarm_id=nat-test"]
    config = config_file(tmp_path, "pipeline.yaml", sets)
    with Lab(3, host_link=False, nat={1: 0}) as lab:
        bootstrap = start(lab, 0, tmp_path, config, cli_env, command="serve", extra=["--stage", "0"])
        natted = start(
            lab, 1, tmp_path, config, cli_env, command="serve", bootstrap=[bootstrap], extra=["--stage", "1"]
        )
        assert_nat_in_place(lab, 0, 1, natted, bootstrap)

        def serving(index: int) -> list[dict]:
            assert lab.alive(index), (tmp_path / f"n{index}.out").read_text()[-3000:]
            return recoveries(tmp_path / f"n{index}")

        for index in range(2):
            wait_for(lambda: serving(index), 180, f"stage server {index} to serve", interval=1)
        relayed = [a for a in (tmp_path / "n1" / "addresses.txt").read_text().split() if "/p2p-circuit/" in a]
        assert relayed and bootstrap.split("/p2p/")[-1] in relayed[0], relayed  # its slot is on the bootstrap node
        start(lab, 2, tmp_path, config, cli_env, command="drive", bootstrap=[bootstrap])

        def stepped():
            assert lab.alive(2), (tmp_path / "n2.out").read_text()[-3000:]
            rows = read_rows(tmp_path / "n2")
            return rows if len(rows) >= 3 else None

        assert_trains(wait_for(stepped, 300, "the driver to take 3 steps through the NAT'd stage 1", interval=1))


# the relay of the relay-restart tests listens on a fixed port, as a bootstrap node others were given must
RELAY_PORT = 40100
LOST = "lost its relay slot"  # the session's warning (node/transport/session.py)
REGAINED = "peers can now dial it at"  # the session's note when the node has a /p2p-circuit address again


def fixed_port(lab: Lab, index: int) -> list[str]:
    return ["--set", f'swarm.host_maddrs=["/ip4/{lab.ip(index)}/tcp/{RELAY_PORT}"]']


def log_times(tmp_path, index: int, needle: str) -> list[float]:
    """When node `index` logged a line containing `needle` (node.log's stamps: local time, milliseconds)."""
    path = tmp_path / f"n{index}" / "node.log"
    lines = path.read_text().splitlines() if path.exists() else []
    return [
        time.mktime(time.strptime(line[:19], "%Y-%m-%d %H:%M:%S")) + int(line[20:23]) / 1000
        for line in lines
        if needle in line
    ]


def circuit_on(tmp_path, index: int, relay: str) -> bool:
    """Whether node `index`'s addresses.txt holds a /p2p-circuit address through `relay`."""
    relay_id = relay.split("/p2p/")[-1]
    return any(
        f"/p2p/{relay_id}/p2p-circuit/" in a for a in (tmp_path / f"n{index}" / "addresses.txt").read_text().split()
    )


def restart_relay(lab: Lab, tmp_path, env, relay: str, natted: tuple[int, ...], bootstrap: list[str] = ()) -> dict:
    """Kill -9 node 0 (the relay), wait until every NAT'd node found its slot gone, start node 0 again with the same
    state directory and address (joining `bootstrap`, if given), wait until every NAT'd node announces a circuit
    address through it again. What happened when, in seconds from the kill."""
    for index in natted:
        wait_for(lambda: circuit_on(tmp_path, index, relay), 120, f"node {index}'s relay slot", interval=0.5)
    killed = time.time()
    lab.kill(0)
    for index in natted:
        wait_for(
            lambda: lab.alive(index) and [t for t in log_times(tmp_path, index, LOST) if t >= killed - 1],
            120,
            f"node {index} to find its relay slot gone",
            interval=0.5,
        )
    (tmp_path / "n0" / "addresses.txt").unlink()
    argv = lab.processes[0].argv
    lab.run(0, [*argv, "--initial-peers", *bootstrap] if bootstrap else argv, lab.processes[0].log, env)
    back = wait_for(
        lambda: lab.alive(0) and (tmp_path / "n0" / "addresses.txt").exists() and time.time(),
        180,
        "the relay to listen again",
        interval=0.5,
    )
    assert (tmp_path / "n0" / "addresses.txt").read_text().split()[0] == relay  # same key, same address
    regained = {}
    for index in natted:
        regained[index] = wait_for(
            lambda: (
                lab.alive(index)
                and circuit_on(tmp_path, index, relay)
                and [t for t in log_times(tmp_path, index, REGAINED) if t >= back - 1]
            ),
            300,
            f"node {index} to announce a circuit address through the restarted relay",
            interval=0.5,
        )[0]
    return {
        "relay_back_s": round(back - killed, 1),
        "slot_lost_logged_s": {i: round(log_times(tmp_path, i, LOST)[-1] - killed, 1) for i in natted},
        "circuit_announced_again_s": {i: round(t - killed, 1) for i, t in regained.items()},
        "back": back,
    }


@pytest.mark.slow
def test_nodes_behind_two_nats_train_on_each_others_rollouts_again_after_their_relay_restarts(
    tmp_path, model_cache, cli_env
):
    config = config_file(tmp_path, "swarm.yaml", SWARM_SETS)
    with Lab(3, host_link=False, nat={1: 0, 2: 1}) as lab:
        relay = start(lab, 0, tmp_path, config, cli_env, extra=fixed_port(lab, 0))
        natted = [start(lab, i, tmp_path, config, cli_env, bootstrap=[relay]) for i in (1, 2)]
        for index, address in zip((1, 2), natted):
            assert_nat_in_place(lab, 0, index, address, relay)
        wait_uses(lab, tmp_path, 1, 2)
        wait_uses(lab, tmp_path, 2, 1)
        summary = restart_relay(lab, tmp_path, cli_env, relay, natted=(1, 2))
        pairs = [(1, 2), (2, 1), (1, 0), (2, 0)]  # (user, source)
        marks = {(u, s): questions_used(tmp_path, u).get(node_id(tmp_path, s), 0) for u, s in pairs}
        used_again = {}
        for user, source in pairs:

            def more() -> bool:
                assert lab.alive(user), (tmp_path / f"n{user}.out").read_text()[-3000:]
                return questions_used(tmp_path, user).get(node_id(tmp_path, source), 0) > marks[user, source]

            wait_for(more, 300, f"node {user} to train on node {source}'s rollouts again", interval=1)
            used_again[f"{user}<-{source}"] = round(time.time() - summary["back"], 1)
        assert all(lab.alive(i) for i in range(3)) and lab.processes[1].restarts == lab.processes[2].restarts == 0
        summary["rollouts_used_again_s_after_relay_back"] = used_again  # an upper bound: polled one pair at a time
        print(json.dumps({k: v for k, v in summary.items() if k != "back"}))  # for the notebook (pytest -s)


@pytest.mark.slow
def test_a_driver_behind_nat_steps_again_through_a_stage_server_behind_another_nat_after_their_relay_restarts(
    tmp_path, model_cache, cli_env
):
    """The relay is a public server of stage 0, which a second public server replicates: stage 1's server and the
    driver sit behind two different NATs, so the driver's calls to stage 1 can only go through the relay. While it is
    down the driver finds stage 1 lost and waits; once the relay is back (restarted with the other stage-0 server as
    its bootstrap peer), both get a slot again and the driver steps again. Only the restarted relay loaded weights
    again (from its replica, as a restarted server does): neither server that kept running rebuilt its stage. (A
    spare as the relay does not stay one: it takes stage 1 while that stage's server is still starting.) Stage 1's
    server starts before the second stage-0 server, or a replica of stage 0 would move to the empty stage 1."""
    sets = [*PIPELINE_OVERRIDES, "pipeline.num_stages=2", "swarm.swarm_id=nat-test"]
    config = config_file(tmp_path, "pipeline.yaml", sets)
    with Lab(4, host_link=False, nat={2: 0, 3: 1}) as lab:
        serve = functools.partial(start, lab, tmp_path=tmp_path, config=config, env=cli_env, command="serve")

        def serving(index: int) -> list[dict]:
            assert lab.alive(index), (tmp_path / f"n{index}.out").read_text()[-3000:]
            return recoveries(tmp_path / f"n{index}")

        relay = serve(index=0, extra=["--stage", "0", *fixed_port(lab, 0)])
        natted = serve(index=2, bootstrap=[relay], extra=["--stage", "1"])
        assert_nat_in_place(lab, 0, 2, natted, relay)
        for index in (0, 2):
            wait_for(lambda: serving(index), 180, f"stage server {index} to serve", interval=1)
        second = serve(index=1, bootstrap=[relay], extra=["--stage", "0"])
        wait_for(lambda: serving(1), 180, "the second server of stage 0 to serve", interval=1)
        driver = start(lab, 3, tmp_path, config, cli_env, command="drive", bootstrap=[relay])
        assert_nat_in_place(lab, 0, 3, driver, relay)

        def steps_after(moment: float) -> list[dict]:
            assert lab.alive(3), (tmp_path / "n3.out").read_text()[-3000:]
            return [row for row in read_rows(tmp_path / "n3") if row["time"] > moment]

        wait_for(lambda: len(steps_after(0)) >= 3, 300, "the driver's first 3 steps", interval=1)
        kept = {i: serving(i) for i in (1, 2)}
        killed = time.time()
        # restarted into the live swarm, as an operator would: the founder restarted alone sees no stage map yet when it
        # loads its stage, and starts it from the initial weights
        summary = restart_relay(lab, tmp_path, cli_env, relay, natted=(2, 3), bootstrap=[second])
        after = wait_for(lambda: steps_after(summary["back"]), 300, "the driver to step again", interval=1)
        assert_trains(after)
        assert all(lab.alive(i) for i in range(4)) and all(lab.processes[i].restarts == 0 for i in (1, 2, 3))
        assert {i: serving(i) for i in (1, 2)} == kept  # nothing rebuilt by a server that kept running
        reloaded = wait_for(lambda: serving(0)[1:], 180, "the restarted relay to serve stage 0 again", interval=1)
        assert [e["method"] for e in reloaded] == ["replica_copy"], reloaded
        lost = [
            line[:23] + line[line.index(" stage") :]
            for line in (tmp_path / "n3" / "node.log").read_text().splitlines()
            if " lost (" in line
        ]
        summary.update(
            steps_during_outage=len([r for r in read_rows(tmp_path / "n3") if killed < r["time"] <= summary["back"]]),
            first_step_after_relay_back_s=round(after[0]["time"] - summary["back"], 1),
            driver_found_lost=lost,
            relay_reloaded_stage_0_by=reloaded[0]["method"],
        )
        print(json.dumps({k: v for k, v in summary.items() if k != "back"}))  # for the notebook (pytest -s)
