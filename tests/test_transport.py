"""Which rollout transport a node gets: the one swarm.transport names (node/transport/__init__.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from node.config import load_config
from node.stats import SwarmStats
from node.transport import build_transport, needs_session
from node.transport.dht import DHTTransport
from node.transport.null import NullTransport
from protocol import NodeIdentity
from tests.helpers.common import REPO


def config_of(transport: str):
    return load_config(REPO / "configs" / "isolated.yaml", [f"swarm.transport={transport}"])


def heartbeat():
    raise AssertionError("building a transport publishes nothing")


def test_an_isolated_node_gets_the_null_transport_without_a_session():
    config = config_of("none")
    assert not needs_session(config)
    assert isinstance(build_transport(config, None, SwarmStats(), "fingerprint", heartbeat), NullTransport)


def test_a_swarm_node_gets_the_dht_transport_over_its_session():
    config = config_of("dht")
    assert needs_session(config)
    # what DHTTransport reads of a session when it is built; it starts nothing until start()
    session = SimpleNamespace(config=config, identity=NodeIdentity.generate(), prefix="swarm-node/v1/test")
    transport = build_transport(config, session, SwarmStats(), "fingerprint", heartbeat)
    assert isinstance(transport, DHTTransport) and transport.session is session
    with pytest.raises(ValueError, match="'dht' needs the node's open swarm session"):
        build_transport(config, None, SwarmStats(), "fingerprint", heartbeat)
