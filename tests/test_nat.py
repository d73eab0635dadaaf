"""Nodes behind home routers (benchmarks/lab.py's NAT: MASQUERADE out, only replies in) take full
part: rollouts both ways, NoLoCo pairing, two nodes behind two different NATs, and a stage server
behind NAT driven by a public driver that never had a connection to it (through the bootstrap
node's circuit relay). Each test first checks that the NAT is really there: a direct dial from a
public node to the NAT'd node's listening port fails, while the NAT'd node dials out."""

from __future__ import annotations

import functools
import json
import sys

import pytest

from node.config import dump_config, load_config
from protocol import NodeIdentity
from tests.helpers.common import REPO, TINY_OVERRIDES
from tests.helpers.pipeline import PIPELINE_OVERRIDES, assert_trains, recoveries
from tests.helpers.netlab import start_command
from tests.helpers.swarm import peers_listed, read_rows, wait_for

sys.path.insert(0, str(REPO / "benchmarks"))
from lab import Lab, lab_unavailable  # noqa: E402

pytestmark = pytest.mark.skipif(lab_unavailable() is not None, reason=str(lab_unavailable()))

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
