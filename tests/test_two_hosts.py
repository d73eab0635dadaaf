"""Two swarm nodes on two "hosts": network namespaces joined by a veth pair (198.18.0.1 / 198.18.0.2), so that
nothing can pass through 127.0.0.1 or a wildcard address by accident. Loopback hid that gossip advertised
/ip4/0.0.0.0 addresses; here gossipsub must connect across the link, and the DHT must carry rollouts too."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import uuid

import pytest

from node.config import dump_config, load_config
from node.transport.dht import routable_gossip_addresses
from tests.helpers.common import REPO, cli
from tests.helpers.swarm import SWARM_OVERRIDES, peers_listed, read_rows, wait_for


def _netns_unavailable() -> str | None:
    """Why this machine cannot run the namespace test (None: it can)."""
    if os.geteuid() != 0:
        return "network namespaces need root (run the tests as root to cover gossip across hosts)"
    if shutil.which("ip") is None or subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0:
        return "`ip netns` is unavailable (install iproute2)"
    return None


needs_netns = pytest.mark.skipif(_netns_unavailable() is not None, reason=str(_netns_unavailable()))
PEER = "/p2p/12D3KooWGossipPeer"


def test_a_wildcard_listener_is_advertised_at_the_nodes_dht_ips_routable_first():
    dht = ["/ip4/127.0.0.1/tcp/4000/p2p/X", "/ip4/198.18.0.1/tcp/4000/p2p/X", "/ip4/198.18.0.1/udp/4000/quic/p2p/X"]
    assert routable_gossip_addresses([f"/ip4/0.0.0.0/tcp/5000{PEER}"], dht) == [
        f"/ip4/198.18.0.1/tcp/5000{PEER}",
        f"/ip4/127.0.0.1/tcp/5000{PEER}",
    ]


def test_announced_addresses_are_what_a_wildcard_listener_advertises():
    # p2pd reports swarm.announce_maddrs (e.g. a public IP behind NAT) instead of its interfaces.
    assert routable_gossip_addresses([f"/ip4/0.0.0.0/tcp/5000{PEER}"], ["/ip4/203.0.113.7/tcp/31337/p2p/X"]) == [
        f"/ip4/203.0.113.7/tcp/5000{PEER}"
    ]


def test_a_specific_listening_ip_is_advertised_as_it_is():
    assert routable_gossip_addresses([f"/ip4/198.18.0.2/tcp/5000{PEER}"], ["/ip4/127.0.0.1/tcp/4000/p2p/X"]) == [
        f"/ip4/198.18.0.2/tcp/5000{PEER}"
    ]
    assert routable_gossip_addresses(
        [f"/ip6/::/tcp/5000{PEER}"], ["/ip6/fd00::2/tcp/4000/p2p/X", "/ip4/10.0.0.2/tcp/4000/p2p/X"]
    ) == [f"/ip6/fd00::2/tcp/5000{PEER}"]


@pytest.fixture
def two_hosts():
    """Two namespaces named with a unique tag, joined by a veth pair; both deleted at the end (and so the pair)."""
    tag = f"sn{uuid.uuid4().hex[:6]}"
    a, b = f"{tag}-a", f"{tag}-b"

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True)

    try:
        ip("netns", "add", a)
        ip("netns", "add", b)
        ip("link", "add", f"{tag}va", "type", "veth", "peer", "name", f"{tag}vb")
        ip("link", "set", f"{tag}va", "netns", a)
        ip("link", "set", f"{tag}vb", "netns", b)
        ip("-n", a, "addr", "add", "198.18.0.1/24", "dev", f"{tag}va")
        ip("-n", b, "addr", "add", "198.18.0.2/24", "dev", f"{tag}vb")
        for ns, dev in ((a, f"{tag}va"), (b, f"{tag}vb")):
            ip("-n", ns, "link", "set", "lo", "up")
            ip("-n", ns, "link", "set", dev, "up")
        yield a, b
    finally:
        for ns in (a, b):  # deleting a namespace removes its end of the veth pair, and so the pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@pytest.mark.integration
@needs_netns
def test_gossip_and_rollouts_cross_two_hosts(model_cache, tmp_path, cli_env, two_hosts):
    from node.model import ensure_default_model

    overrides = [o for o in SWARM_OVERRIDES if not o.startswith("swarm.host_maddrs")] + ["swarm.gossip=libp2p"]
    config = load_config(REPO / "configs" / "swarm.yaml", overrides)  # listens on 0.0.0.0: the case loopback hid
    ensure_default_model(config, progress=False)
    path = tmp_path / "swarm.yaml"
    path.write_text(dump_config(config))
    processes, logs = [], []

    def start(ns: str, name: str, *extra: str) -> subprocess.Popen:
        log = open(tmp_path / f"{name}.out", "w")
        logs.append(log)
        process = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                ns,
                *cli("join", "--config", str(path), "--state-dir", str(tmp_path / name), *extra),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=cli_env,
            cwd=REPO,
            start_new_session=True,
        )
        processes.append(process)
        return process

    try:
        first = start(two_hosts[0], "a")
        address = wait_for(
            lambda: (
                first.poll() is None
                and (tmp_path / "a" / "addresses.txt").exists()
                and next(
                    (a for a in (tmp_path / "a" / "addresses.txt").read_text().split() if "/198.18.0.1/" in a), None
                )
            ),
            180,
            "node a's 198.18.0.1 address",
        )
        start(two_hosts[1], "b", "--initial-peers", address)

        def gossip_received(name: str) -> int:
            path = tmp_path / name / "swarm.json"
            return json.loads(path.read_text())["totals"]["gossip_messages_received"] if path.exists() else 0

        for name in ("a", "b"):
            wait_for(
                lambda: all(p.poll() is None for p in processes) and gossip_received(name) > 0,
                240,
                f"node {name} to receive rollouts over gossipsub",
                interval=1,
            )
            wait_for(
                lambda: any(r.get("external_questions", 0) > 0 for r in read_rows(tmp_path / name)),
                240,
                f"node {name} to train on the other's rollouts",
                interval=1,
            )
        # What each node advertises, as a third party on host b reads it from the DHT: dialable addresses only.
        rows = peers_listed(address, "test-swarm", cli_env, netns=two_hosts[1], must_succeed=True)
        advertised = {row["node_id"]: row["gossip_addresses"] for row in rows}
        assert len(advertised) == 2 and all(advertised.values()), advertised
        assert not [a for addresses in advertised.values() for a in addresses if "/0.0.0.0/" in a or "/ip6/::/" in a], (
            advertised
        )
        assert {"/198.18.0.1/", "/198.18.0.2/"} <= {
            f"/{a.split('/')[2]}/" for addresses in advertised.values() for a in addresses
        }, advertised
        for name in ("a", "b"):
            logged = (tmp_path / f"{name}.out").read_text() + (tmp_path / name / "node.log").read_text()
            unreachable = [
                line for line in logged.splitlines() if "could not reach gossip peer" in line and "0.0.0.0" in line
            ]
            assert not unreachable, unreachable[:3]  # nobody was told to dial a wildcard address
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
        for log in logs:
            log.close()
