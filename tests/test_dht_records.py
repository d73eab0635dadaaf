"""DHT records one level below the envelope: the validator's rules, reads that one bad value cannot
poison, and real nodes under a record-level attack by a client-mode DHT peer."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import msgpack
import pytest

from node.stats import RecordRefusals
from node.transport.records import RECORD_TTL_S, RecordWriter, SwarmRecordValidator, read_records
from protocol import shards as shard_keys
from protocol import AveragingReady, MessageKind, NodeIdentity, decode_message, encode_message
from tests.helpers.messages import stats_message
from tests.helpers.swarm import SwarmProcess, peers_listed, read_rows, wait_for

SWARM = "test-swarm"
log = logging.getLogger(__name__)


def heartbeat(identity: NodeIdentity, now: float, **fields) -> bytes:
    return encode_message(
        stats_message(identity, now), identity=identity, swarm_id=fields.get("swarm", SWARM), seq=1, timestamp=now
    )


def record(subkey, value: bytes, expiration: float, raw_value: bool = False, raw_subkey: bool = False):
    from hivemind.dht.validation import DHTRecord

    return DHTRecord(
        key=b"k" * 20,
        subkey=subkey if raw_subkey else msgpack.packb(subkey),
        value=value if raw_value else msgpack.packb(value),
        expiration_time=expiration,
    )


def test_validator_rules(monkeypatch):
    validator = SwarmRecordValidator(SWARM)
    me, other = NodeIdentity.generate(), NodeIdentity.generate()
    now = time.time()
    good = heartbeat(me, now)
    lifetime = RECORD_TTL_S[MessageKind.PEER_STATS]
    assert validator.check(record(me.node_id, good, now + lifetime)) == (None, me.node_id, "")  # exactly its lifetime
    cases = {
        "no_subkey": record(None, good, now + 30),
        "bad_subkey": record("not-a-node-id", good, now + 30),
        "not_msgpack": record(me.node_id, b"\xc1\xc1 raw bytes", now + 30, raw_value=True),
        "bad_structure": record(me.node_id, 5, now + 30),  # msgpack, but not the bytes of an envelope
        "sender_mismatch": record(other.node_id, good, now + 30),  # my genuine value under someone else's subkey
        "bad_signature": record(me.node_id, good[:-3] + bytes(3), now + 30),
        "wrong_swarm": record(me.node_id, heartbeat(me, now, swarm="other"), now + 30),
        "stale": record(me.node_id, heartbeat(me, now + 3600), now + 3600 + 30),  # signed in the future
        "expiration_too_late": record(me.node_id, good, now + lifetime + 0.01),  # a replay made to outlive newer values
        "too_large": record(me.node_id, b"\x00" * 2_000_000, now + 30),
    }
    for reason, bad in cases.items():
        assert validator.check(bad)[0] == reason, reason
        assert validator.validate(bad) is False
    assert validator.check(record(b"\xc1", good, now + 30, raw_subkey=True))[0] == "bad_subkey"
    assert validator.refusals.by_reason == {reason: 1 for reason in cases}
    assert validator.refusals.by_owner[other.node_id] == {"sender_mismatch": 1}
    ready = encode_message(
        AveragingReady(p2p_peer_id="12D3Koo", round=3, state="free"), identity=me, swarm_id=SWARM, seq=2, timestamp=now
    )
    assert validator.validate(record(me.node_id, ready, now + 60))
    monkeypatch.delitem(RECORD_TTL_S, MessageKind.AVERAGING_READY)  # a kind this node does not store in the DHT
    assert validator.check(record(me.node_id, ready, now + 60))[0] == "unknown_kind"


def test_every_message_kind_has_a_record_lifetime():
    assert set(RECORD_TTL_S) == set(MessageKind)  # a new kind stored in the DHT needs one (see records.py)


def test_a_stored_record_stays_valid_as_it_ages():
    """hivemind drops a peer's whole dictionary when one subkey fails: validity must not decay with age."""
    me = NodeIdentity.generate()
    now = time.time()
    value = record(me.node_id, heartbeat(me, now), now + RECORD_TTL_S[MessageKind.PEER_STATS])
    for later in (0, 299, 10_000):
        assert SwarmRecordValidator(SWARM, clock=lambda: now + later).validate(value)


def test_a_replay_loses_to_the_owners_newer_record():
    """Writers store for exactly the kind's lifetime after signing, so no admissible replay outlives a newer record."""
    from hivemind.dht.routing import DHTID
    from hivemind.dht.storage import DHTLocalStorage

    me = NodeIdentity.generate()
    writer = RecordWriter(me, SWARM)
    old = writer.sign(stats_message(me, time.time()))
    time.sleep(0.01)
    new = writer.sign(stats_message(me, time.time()))
    for signed in (old, new):
        assert (
            signed.expiration
            == decode_message(signed.data, swarm_id=SWARM).timestamp + RECORD_TTL_S[MessageKind.PEER_STATS]
        )
    validator = SwarmRecordValidator(SWARM)
    replay_at_most = record(me.node_id, old.data, old.expiration)
    assert validator.validate(replay_at_most) and not validator.validate(record(me.node_id, old.data, new.expiration))
    key = DHTID.generate(source="peers")
    for order in ((new, old), (old, new)):  # the replay stored after the newer record, and before it
        storage = DHTLocalStorage()
        for signed in order:
            storage.store_subkey(key, me.node_id, msgpack.packb(signed.data), signed.expiration)
        assert storage.get(key).value.get(me.node_id).value == msgpack.packb(new.data)


def test_refusals_are_counted_once_and_logged_once_a_minute(caplog):
    refusals = RecordRefusals()
    validator = SwarmRecordValidator(SWARM, refusals=refusals)
    me = NodeIdentity.generate()
    now = time.time()
    bad = [record(me.node_id, b"\xc1" + bytes([i]), now + 30, raw_value=True) for i in range(5)]
    with caplog.at_level(logging.INFO, logger="node.stats"):
        for _ in range(3):  # hivemind retries refused stores; a peer returns the same bad record to every lookup
            for item in bad:
                assert not validator.validate(item)
    assert refusals.by_reason == {"not_msgpack": 5} and refusals.by_owner[me.node_id] == {"not_msgpack": 5}
    assert len([r for r in caplog.records if "refused a DHT record" in r.getMessage()]) == 1


@pytest.mark.integration
def test_a_node_that_skips_validation_cannot_poison_a_read():
    """Second line: a DHT node without the validator (here, hostile) holds an undecodable value and a plain value
    beside a genuine record; an honest reader still reads the genuine record, counts the bad ones, and no
    hivemind task dies with an unretrieved exception."""
    asyncio.run(_poisoned_holder_scenario())


async def _poisoned_holder_scenario():
    from hivemind.dht.node import DHTNode
    from hivemind.dht.routing import DHTID

    from node.transport.joining import key_prefix, shutdown_dht

    loop_errors: list[dict] = []
    asyncio.get_running_loop().set_exception_handler(lambda _loop, context: loop_errors.append(context))
    honest_refusals, reader_refusals = RecordRefusals(), RecordRefusals()
    maddrs = ["/ip4/127.0.0.1/tcp/0"]
    honest = await DHTNode.create(
        host_maddrs=maddrs, record_validator=SwarmRecordValidator(SWARM, refusals=honest_refusals)
    )
    address = [str(a) for a in await honest.get_visible_maddrs()]
    holder = await DHTNode.create(initial_peers=address, host_maddrs=maddrs)  # no validator: stores anything
    reader = await DHTNode.create(
        initial_peers=[str(a) for a in await holder.get_visible_maddrs()],
        host_maddrs=maddrs,
        client_mode=True,
        record_validator=SwarmRecordValidator(SWARM, refusals=reader_refusals),
    )
    try:
        key = f"{key_prefix(SWARM)}/peers"
        me = NodeIdentity.generate()
        assert await RecordWriter(me, SWARM).store(honest, key, stats_message(me, time.time()), timeout=30)
        key_id = DHTID.generate(source=key)
        far = time.time() + 3600
        # straight into its storage
        holder.protocol.storage.store_subkey(key_id, "f" * 40, b"\xc1\xc1 not msgpack", far)
        holder.protocol.storage.store_subkey(key_id, "e" * 40, msgpack.packb(b"junk"), far)
        started = time.monotonic()
        envelopes = await read_records(reader, key, SWARM, MessageKind.PEER_STATS, timeout=60, limit=256)
        log.info("read of a key a non-validating holder poisoned: %.2fs", time.monotonic() - started)
        assert [e.sender_id for e in envelopes] == [me.node_id]  # read (not timed out), and only the genuine record
        assert set(reader_refusals.by_reason) & {"not_msgpack", "bad_structure"}
        await asyncio.sleep(0.5)  # let any failed hivemind task be collected
        assert not loop_errors, loop_errors
    finally:
        for node in (reader, holder, honest):
            await shutdown_dht(node)


def peers_json(env, address: str) -> list[dict]:
    return peers_listed(address, SWARM, env, must_succeed=True)


async def attack(address: str, honest_id: str, seconds: float) -> dict[str, int]:
    """A client-mode DHT peer with the project's source in hand writes poison straight into the honest node's
    storage."""
    from hivemind.dht.node import DHTNode
    from hivemind.dht.routing import DHTID
    from hivemind.p2p import PeerID
    from hivemind.utils import get_dht_time

    from node.transport.joining import key_prefix, shutdown_dht

    attacker = await DHTNode.create(initial_peers=[address], client_mode=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    target = PeerID.from_base58(address.rsplit("/p2p/", 1)[1])
    me = NodeIdentity.generate()
    prefix = key_prefix(SWARM)
    # where the honest node's heartbeat lives
    peers_key = shard_keys.peers_key(prefix, shard_keys.shard_of(honest_id, shard_keys.HEARTBEAT_SHARDS))
    window = int(time.time() // 2)
    keys = [peers_key] + [shard_keys.rollout_key(prefix, window + k, count, 0) for k in range(4) for count in (1, 2)]
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
                "forged_ready": [
                    (
                        f"{key_prefix(SWARM)}/avg/x/ready/1",
                        msgpack.packb(
                            encode_message(
                                AveragingReady(p2p_peer_id="x", round=1, state="free"),
                                identity=me,
                                swarm_id=SWARM,
                                seq=3,
                                timestamp=time.time(),
                            )
                        ),
                        honest_id,
                    )
                ],
            }
            if replay is not None:
                attempts["replay_far_expiration"] = [(peers_key, msgpack.packb(replay), honest_id)]
            for name, items in attempts.items():
                for key, value, subkey in items:
                    result = await attacker.protocol.call_store(
                        target, [DHTID.generate(source=key)], [value], far, subkeys=[subkey]
                    )
                    accepted[name] = accepted.get(name, 0) + sum(bool(ok) for ok in result or [])
            await asyncio.sleep(0.5)
    finally:
        await shutdown_dht(attacker)
    return accepted


@pytest.mark.integration
def test_a_record_level_attacker_cannot_blind_the_swarm(swarm_yaml, tmp_path, cli_env, nodes):  # noqa: F811 - fixtures
    honest = SwarmProcess(swarm_yaml, tmp_path / "honest", cli_env)
    nodes.append(honest)
    address = honest.addresses()[0]
    honest_id = wait_for(
        lambda: (
            (honest.state_dir / "identity.key").exists()
            and NodeIdentity.load_or_create(honest.state_dir / "identity.key").node_id
        ),
        60,
        "identity",
    )
    wait_for(lambda: honest.assert_running() or len(read_rows(honest.state_dir)) >= 2, 180, "the honest node to train")
    rounds_before = len(read_rows(honest.state_dir))

    accepted = asyncio.run(attack(address, honest_id, seconds=8))
    assert accepted and not any(accepted.values()), accepted  # the honest node stored none of it

    listed = wait_for(
        lambda: [p for p in peers_json(cli_env, address) if p["node_id"] == honest_id],
        60,
        "peers to list the honest node",
        interval=1,
    )
    assert listed
    wait_for(
        lambda: honest.assert_running() or len(read_rows(honest.state_dir)) >= rounds_before + 3,
        180,
        "the honest node to keep training",
    )
    swarm = wait_for(
        lambda: (
            (honest.state_dir / "swarm.json").exists()
            and json.loads((honest.state_dir / "swarm.json").read_text())["totals"]["dht_records_rejected"]
        ),
        60,
        "refusals in swarm.json",
    )
    assert {"not_msgpack", "no_subkey", "sender_mismatch"} <= set(swarm), swarm
    if "replay_far_expiration" in accepted:
        assert "expiration_too_late" in swarm
    output = honest.output()
    assert "Task exception was never retrieved" not in output and "Traceback" not in output
    assert "did not accept" not in output  # its own heartbeat and rollouts were still stored
