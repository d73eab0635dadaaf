"""DHT records one level below the envelope: the validator's rules, and a real node under a record-level attack."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time

import msgpack

from node.transport.records import MAX_RECORD_TTL_S, SwarmRecordValidator
from protocol import AveragingReady, MessageKind, NodeIdentity, PeerStats, encode_message
from tests.conftest import REPO, cli
from tests.swarm_helpers import SwarmProcess, read_rows, wait_for
from tests.test_swarm import nodes, swarm_yaml  # noqa: F401 - fixtures

SWARM = "test-swarm"


def heartbeat(identity: NodeIdentity, now: float, **fields) -> bytes:
    stats = PeerStats(node_id=identity.node_id, display_name="x", software_version="0", protocol_version="1.1", model_name="m", model_parameters=1,
                      round=1, policy_version=1, reward_mean=0.0, accuracy=0.0, rollouts_published=0, rollouts_received=0, rollouts_accepted=0,
                      rollouts_rejected=0, tokens_per_s=0.0, uptime_s=0.0, last_seen=now, addresses=[], gossip_addresses=[], outer_steps=0, outer_steps_skipped=0)
    return encode_message(stats, identity=identity, swarm_id=fields.get("swarm", SWARM), seq=1, timestamp=now)


def record(subkey, value: bytes, expiration: float, raw_value: bool = False):
    from hivemind.dht.validation import DHTRecord

    return DHTRecord(key=b"k" * 20, subkey=msgpack.packb(subkey), value=value if raw_value else msgpack.packb(value), expiration_time=expiration)


def test_validator_rules():
    validator = SwarmRecordValidator(SWARM)
    me, other = NodeIdentity.generate(), NodeIdentity.generate()
    now = time.time()
    good = heartbeat(me, now)
    assert validator.check(record(me.node_id, good, now + 30)) == (None, me.node_id, "")
    cases = {
        "no_subkey": record(None, good, now + 30),
        "bad_subkey": record("not-a-node-id", good, now + 30),
        "not_msgpack": record(me.node_id, b"\xc1\xc1 raw bytes", now + 30, raw_value=True),
        "bad_structure": record(me.node_id, 5, now + 30),  # msgpack, but not the bytes of an envelope
        "sender_mismatch": record(other.node_id, good, now + 30),  # my genuine value under someone else's subkey
        "bad_signature": record(me.node_id, good[:-3] + bytes(3), now + 30),
        "wrong_swarm": record(me.node_id, heartbeat(me, now, swarm="other"), now + 30),
        "expiration_too_late": record(me.node_id, good, now + MAX_RECORD_TTL_S[MessageKind.PEER_STATS] + 3600),  # a replay made to outlive newer values
        "too_large": record(me.node_id, b"\x00" * 2_000_000, now + 30),
    }
    for reason, bad in cases.items():
        assert validator.check(bad)[0] == reason, reason
        assert validator.validate(bad) is False
    assert validator.refusals.by_reason == {reason: 1 for reason in cases}
    ready = encode_message(AveragingReady(p2p_peer_id="12D3Koo", round=3, state="free"), identity=me, swarm_id=SWARM, seq=2, timestamp=now)
    assert validator.validate(record(me.node_id, ready, now + 60))


def peers_json(env, address: str) -> list[dict]:
    result = subprocess.run(cli("peers", "--initial-peers", address, "--swarm-id", SWARM, "--json"), capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


async def attack(address: str, honest_id: str, seconds: float) -> dict[str, int]:
    """A client-mode DHT peer with the project's source in hand writes poison straight into the honest node's storage."""
    from hivemind.dht.node import DHTNode
    from hivemind.dht.routing import DHTID
    from hivemind.p2p import PeerID
    from hivemind.utils import get_dht_time

    from node.transport.dht import key_prefix, shutdown_dht

    attacker = await DHTNode.create(initial_peers=[address], client_mode=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    target = PeerID.from_base58(address.rsplit("/p2p/", 1)[1])
    me = NodeIdentity.generate()
    peers_key = f"{key_prefix(SWARM)}/peers"
    window = int(time.time() // 2)
    keys = [peers_key] + [f"{key_prefix(SWARM)}/rollouts/{window + k}" for k in range(4)]
    accepted: dict[str, int] = {}
    try:
        genuine = await attacker.get(peers_key, latest=True)
        replay = genuine.value[honest_id].value if genuine is not None and honest_id in genuine.value else None
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            far = get_dht_time() + 3600
            attempts = {
                "undecodable": [(key, b"\xc1\xc1 not msgpack", "f" * 40) for key in keys],
                "plain_value": [(key, msgpack.packb(b"blind"), None) for key in keys],
                "forged_owner": [(peers_key, msgpack.packb(heartbeat(me, time.time())), honest_id)],
                "forged_ready": [(f"{key_prefix(SWARM)}/avg/x/ready/1", msgpack.packb(encode_message(AveragingReady(p2p_peer_id="x", round=1, state="free"), identity=me, swarm_id=SWARM, seq=3, timestamp=time.time())), honest_id)],
            }
            if replay is not None:
                attempts["replay_far_expiration"] = [(peers_key, msgpack.packb(replay), honest_id)]
            for name, items in attempts.items():
                for key, value, subkey in items:
                    result = await attacker.protocol.call_store(target, [DHTID.generate(source=key)], [value], far, subkeys=[subkey])
                    accepted[name] = accepted.get(name, 0) + sum(bool(ok) for ok in result or [])
            await asyncio.sleep(0.5)
    finally:
        await shutdown_dht(attacker)
    return accepted


def test_a_record_level_attacker_cannot_blind_the_swarm(swarm_yaml, tmp_path, cli_env, nodes):  # noqa: F811 - fixtures
    honest = SwarmProcess(swarm_yaml, tmp_path / "honest", cli_env)
    nodes.append(honest)
    address = honest.addresses()[0]
    honest_id = wait_for(lambda: (honest.state_dir / "identity.key").exists() and NodeIdentity.load_or_create(honest.state_dir / "identity.key").node_id, 60, "identity")
    wait_for(lambda: honest.assert_running() or len(read_rows(honest.state_dir)) >= 2, 180, "the honest node to train")
    rounds_before = len(read_rows(honest.state_dir))

    accepted = asyncio.run(attack(address, honest_id, seconds=8))
    assert accepted and not any(accepted.values()), accepted  # the honest node stored none of it

    listed = wait_for(lambda: [p for p in peers_json(cli_env, address) if p["node_id"] == honest_id], 60, "peers to list the honest node", interval=1)
    assert listed
    wait_for(lambda: honest.assert_running() or len(read_rows(honest.state_dir)) >= rounds_before + 3, 180, "the honest node to keep training")
    swarm = wait_for(lambda: (honest.state_dir / "swarm.json").exists() and json.loads((honest.state_dir / "swarm.json").read_text())["totals"]["dht_records_rejected"], 60, "refusals in swarm.json")
    assert {"not_msgpack", "no_subkey", "sender_mismatch"} <= set(swarm), swarm
    if "replay_far_expiration" in accepted:
        assert "expiration_too_late" in swarm
    output = honest.output()
    assert "Task exception was never retrieved" not in output and "Traceback" not in output
    assert "did not accept" not in output  # its own heartbeat and rollouts were still stored
