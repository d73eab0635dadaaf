"""compose.yaml checked without a Docker engine: each service's command is parsed by the CLI's
real parser and resolved into a config (unknown flags, keys or values fail), and what the
services share (volumes, the seed's addresses file, the dashboard port, the model cache) is
checked to fit together. `docker-compose config` is run by tests/test_container.py."""

from __future__ import annotations

import shlex

import pytest
import yaml

from node.cli import build_parser
from node.commands import config_from_args
from tests.helpers.common import REPO

COMPOSE = yaml.safe_load((REPO / "compose.yaml").read_text())
SERVICES = COMPOSE["services"]
# What `$(cat /seed/node/addresses.txt)` expands to at run time: one or more multiaddrs.
SEED_ADDRESS = "/ip4/172.18.0.2/tcp/31337/p2p/12D3KooWSeed"


def node_invocation(service: dict) -> list[str]:
    """The `swarm-node ...` arguments that a service's `sh -c` command ends by exec-ing."""
    assert service["entrypoint"] == ["sh", "-c"]
    (script,) = service["command"]
    assert script.count("exec swarm-node ") == 1, script
    command = script.split("exec swarm-node ", 1)[1]
    # Compose turns $$ into $; the shell then substitutes the seed's addresses.
    command = command.replace("$$(cat /seed/node/addresses.txt)", SEED_ADDRESS)
    assert "$" not in command, command
    return shlex.split(command)


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_each_service_runs_a_command_the_cli_accepts(name):
    args = build_parser().parse_args(node_invocation(SERVICES[name]))
    config = config_from_args(args)  # the CLI's own resolution: unknown keys and bad values raise
    assert args.command == "join" and config.swarm.transport == "dht"
    assert config.state_dir == "/state/node"


def test_named_volumes_are_declared_and_mounted_where_the_commands_look():
    declared = set(COMPOSE["volumes"])
    for name, service in SERVICES.items():
        mounts = dict(volume.split(":", 1) for volume in service["volumes"])
        assert set(mounts) <= declared, name
        assert mounts[f"{name}"] == "/state", name  # each node its own state volume
        assert mounts["model-cache"] == "/cache" == service["environment"]["SWARM_NODE_CACHE"], name


def test_joiners_wait_for_the_seeds_addresses_file():
    seed = config_from_args(build_parser().parse_args(node_invocation(SERVICES["node0"])))
    assert seed.swarm.initial_peers == []  # node0 starts the swarm
    for name in ("node1", "node2"):
        service = SERVICES[name]
        assert service["depends_on"] == ["node0"]
        assert "node0:/seed:ro" in service["volumes"]
        # node0's state dir /state/node is /seed/node here; the node writes addresses.txt in it.
        assert "until [ -s /seed/node/addresses.txt ]" in service["command"][0]
        config = config_from_args(build_parser().parse_args(node_invocation(service)))
        assert config.swarm.initial_peers == [SEED_ADDRESS]


def test_the_published_port_is_node0s_dashboard_listening_on_all_interfaces():
    config = config_from_args(build_parser().parse_args(node_invocation(SERVICES["node0"])))
    assert SERVICES["node0"]["ports"] == [f"127.0.0.1:{config.swarm.dashboard_port}:{config.swarm.dashboard_port}"]
    assert config.swarm.dashboard_host == "0.0.0.0"  # inside the container; the host publishes it on loopback only
    assert not any("ports" in SERVICES[name] for name in ("node1", "node2"))


def test_each_node_serves_the_health_endpoint_its_healthcheck_reads_and_restarts_when_it_exits():
    for name, service in SERVICES.items():
        config = config_from_args(build_parser().parse_args(node_invocation(service)))
        assert config.swarm.metrics_port is not None, name  # /readyz lives beside /metrics
        check = service["healthcheck"]["test"]
        assert check[:3] == ["CMD", "swarm-node", "health"], name
        health = build_parser().parse_args(check[2:])  # the CLI accepts it
        assert health.state_dir == config.state_dir and not health.live, name
        assert service["restart"] == "unless-stopped", name
