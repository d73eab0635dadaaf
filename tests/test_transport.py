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


# --- what the batch receiver counts as a replay ----------------------------------------------------------------


def test_an_unseen_older_batch_is_taken_and_one_that_may_have_been_used_and_forgotten_is_a_replay():
    """Gossip and the DHT deliver an honest peer's batches out of order under load: a late DHT read of its older
    batch after the newer push was first contact is news. A replay is a batch this node may have used: seen (skipped)
    or at or below the highest seq its bounded memory let go of that sender (refused)."""
    import time

    from node.transport.batches import SEEN_PER_SENDER, BatchReceiver
    from protocol import RolloutBatch, RolloutCompletion, RolloutQuestion, TaskSpec, encode_message
    from tests.helpers.tasks import ARITHMETIC

    config = config_of("dht")
    stats = SwarmStats()
    receiver = BatchReceiver(config.swarm, "f" * 40, "fingerprint", stats)
    peer = NodeIdentity.generate()
    spec = TaskSpec("basic_arithmetic", ARITHMETIC, seed=1, index=1)
    completion = RolloutCompletion(text="3", token_ids=[1], logprobs=None, finish_reason="stop")
    batch = RolloutBatch(
        round=1,
        policy_version=1,
        model_fingerprint="fingerprint",
        questions=[RolloutQuestion(spec=spec, completions=[completion, completion], claimed_rewards=[1.0, 0.0])],
    )

    def taken(*seqs: int) -> int:
        """Questions taken from `seqs`, each signed afresh (new bytes: only the seq can tell a repeat)."""
        values = [
            (
                peer.node_id,
                encode_message(batch, identity=peer, swarm_id=config.swarm.swarm_id, seq=s, timestamp=time.time()),
            )
            for s in seqs
        ]
        return len(receiver.receive(values, time.time()))

    assert taken(5) == 1 and taken(3) == 1  # first contact was the newer one: the older is news, not a replay
    assert taken(3) == 0 and stats.refusals.by_reason() == {}  # seen: not used twice, and not held against the peer
    assert taken(*range(100, 100 + SEEN_PER_SENDER)) == SEEN_PER_SENDER  # 5, then 3, let go to stay bounded
    assert taken(4) == 0 and stats.refusals.by_peer() == {peer.node_id: {"replay": 1}}  # 4 <= 5: maybe used
    assert taken(6) == 1 and stats.refusals.by_reason() == {"replay": 1}  # above all it let go: never seen, news
    assert stats.peers[peer.node_id].batches_accepted == 2 + SEEN_PER_SENDER + 1
