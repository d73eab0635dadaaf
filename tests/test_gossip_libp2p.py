"""LibP2PGossip on real py-libp2p hosts over 127.0.0.1, in-process; the protobuf shim that lets
hivemind and libp2p share a process, in subprocesses.

Every test stops the hosts it started; waits are bounded.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from contextlib import asynccontextmanager

import pytest

from node.transport.protobuf_shim import import_hivemind_isolated

# This module imports libp2p. hivemind, imported by other test modules in the same pytest
# process, would clash with it unless it is imported through the shim, first.
import_hivemind_isolated()

from node.transport.gossip_libp2p import MAX_MESSAGE_BYTES, THREAD_NAME_PREFIX, LibP2PGossip  # noqa: E402
from tests.helpers.common import REPO  # noqa: E402

pytestmark = pytest.mark.integration

TOPIC = "swarm-node/test/rollouts"
PROBE = b"probe/"  # mesh-readiness probes; a late one may still arrive by gossip, so tests skip them
FENCE = PROBE + b"fence/"  # sent after a sender's messages: once it arrived, so did everything sent before it
WAIT_S = 10.0
SUBPROCESS_TIMEOUT_S = 60.0


async def wait_until(predicate: Callable[[], object], what: str, timeout: float = WAIT_S, interval: float = 0.01):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        await asyncio.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def payloads(node: LibP2PGossip, topic: str = TOPIC) -> list[bytes]:
    return [message for message in node.drain(topic) if not message.startswith(PROBE)]


async def wait_for_mesh(nodes: list[LibP2PGossip], topic: str) -> None:
    """Publish probes until every node has heard every other: the gossipsub meshes are formed."""
    heard = {i: set() for i in range(len(nodes))}
    everyone = set(range(len(nodes)))
    deadline = time.monotonic() + WAIT_S
    while any(not (everyone - {i}) <= heard[i] for i in heard):
        assert time.monotonic() < deadline, f"meshes not formed within {WAIT_S:.0f}s: {heard}"
        for i, node in enumerate(nodes):
            await node.publish(topic, PROBE + str(i).encode())
        await asyncio.sleep(0.05)
        for i, node in enumerate(nodes):
            heard[i].update(int(m[len(PROBE) :]) for m in node.drain(topic) if m.startswith(PROBE))


@asynccontextmanager
async def swarm(size: int, topic: str = TOPIC, **kwargs):
    """Node 0 starts on 127.0.0.1:0; each next node dials the real addresses of those before it."""
    nodes: list[LibP2PGossip] = []
    try:
        known: list[str] = []
        for _ in range(size):
            node = LibP2PGossip(**kwargs)
            nodes.append(node)
            addresses = await node.start()
            await node.subscribe(topic)
            assert await node.connect(known) == len(nodes) - 1
            known += addresses
        await wait_until(lambda: all(n.peer_count() == size - 1 for n in nodes), "full connectivity")
        await wait_for_mesh(nodes, topic)
        yield nodes
    finally:
        await asyncio.gather(*(node.stop() for node in nodes))


async def collect(node: LibP2PGossip, count: int, senders: list[LibP2PGossip], topic: str = TOPIC) -> list[bytes]:
    """Drain node until count messages arrived (bounded); fail if more than count arrive.

    Then every one of `senders` sends a fence, and node is drained until it has them all (bounded): each sender's
    messages arrive in the order it sent them, so whatever it sent before its fence (a duplicate, one of node's own
    messages handed back) has arrived by then, on a loaded machine as on an idle one."""
    received: list[bytes] = []
    fences: set[bytes] = set()

    def take() -> None:
        for message in node.drain(topic):
            if message.startswith(FENCE):
                fences.add(message)
            elif not message.startswith(PROBE):
                received.append(message)

    await wait_until(lambda: take() or len(received) >= count, f"{count} messages")
    tag = os.urandom(4).hex()
    expected = {FENCE + f"{tag}/{k}".encode() for k in range(len(senders))}
    for k, sender in enumerate(senders):
        await sender.publish(topic, FENCE + f"{tag}/{k}".encode())
    await wait_until(lambda: take() or expected <= fences, f"the fences of {len(senders)} sender(s)")
    assert len(received) == count, received
    return received


def gossip_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(THREAD_NAME_PREFIX)]


def test_three_peers_receive_each_others_messages_not_their_own_in_order():
    async def scenario():
        async with swarm(3) as nodes:
            for k in range(5):
                for i, node in enumerate(nodes):
                    await node.publish(TOPIC, f"msg/{i}/{k}".encode())
            for i, node in enumerate(nodes):
                received = await collect(node, 10, [other for other in nodes if other is not node])
                senders = [int(m.split(b"/")[1]) for m in received]
                assert i not in senders, "a node received its own message"
                for sender in set(range(3)) - {i}:
                    in_order = [m for m in received if int(m.split(b"/")[1]) == sender]
                    assert in_order == [f"msg/{sender}/{k}".encode() for k in range(5)]
                assert payloads(node) == [], "drain did not empty the buffer"
            assert nodes[0].drain("never-subscribed") == []

    asyncio.run(scenario())


def test_large_message_arrives_and_oversize_is_refused():
    async def scenario():
        async with swarm(2) as (sender, receiver):
            big = os.urandom(900_000)
            await sender.publish(TOPIC, big)
            assert await collect(receiver, 1, [sender]) == [big]
            largest = os.urandom(MAX_MESSAGE_BYTES)  # the limit itself still fits under pubsub's 1 MiB
            await sender.publish(TOPIC, largest)
            assert await collect(receiver, 1, [sender]) == [largest]
            with pytest.raises(ValueError, match="max_message_bytes"):
                await sender.publish(TOPIC, bytes(1_100_000))

    asyncio.run(scenario())


def test_burst_of_50_from_one_peer_all_arrive():
    """Gossipsub's default spam protection (10 messages/topic/s per peer) would drop 40 of them."""

    async def scenario():
        async with swarm(2) as (sender, receiver):
            burst = [f"burst/{k}".encode() for k in range(50)]
            for message in burst:
                await sender.publish(TOPIC, message)
            assert await collect(receiver, 50, [sender]) == burst
            # Larger messages fill the 32-RPC outbound queue faster than the wire empties it.
            large = [bytes([k]) * 200_000 for k in range(50)]
            for message in large:
                await sender.publish(TOPIC, message)
            assert await collect(receiver, 50, [sender]) == large

    asyncio.run(scenario())


def test_receive_restores_each_senders_order_and_skips_our_own():
    """Pubsub may hand over messages parsed in one scheduler step in any order (one task each)."""
    from libp2p.pubsub.pb import rpc_pb2

    from node.transport.gossip_libp2p import in_sender_order

    arrivals = [(b"a", 2), (b"b", 1), (b"a", 1), (b"us", 1), (b"a", 3)]
    messages = [
        rpc_pb2.Message(from_id=sender, seqno=seqno.to_bytes(8, "big"), data=sender + b"/%d" % seqno)
        for sender, seqno in arrivals
    ]
    assert in_sender_order(messages, own_id=b"us") == [b"a/1", b"a/2", b"a/3", b"b/1"]


def test_buffer_is_bounded_dropping_the_oldest():
    async def scenario():
        async with swarm(2, max_buffered=5) as (sender, receiver):
            # a mesh probe still on its way would take a slot of the 5 and drop one more
            assert await collect(receiver, 0, [sender]) == []
            sent = [f"bounded/{k}".encode() for k in range(8)]
            for message in sent:
                await sender.publish(TOPIC, message)
            await wait_until(lambda: receiver.dropped(TOPIC) >= 3, "3 drops")
            assert payloads(receiver) == sent[3:]
            # whatever else the sender's stream still carried (a duplicate) arrives before its fence
            assert await collect(receiver, 0, [sender]) == []
            assert receiver.dropped(TOPIC) == 3

    asyncio.run(scenario())


def test_connect_never_raises_and_counts_only_new_connections():
    async def scenario():
        gone = LibP2PGossip()
        gone_addresses = await gone.start()
        await gone.stop()
        unreachable = [
            *gone_addresses,  # nobody listens there any more
            "not a multiaddr",
            "/ip4/127.0.0.1/tcp/1",  # no /p2p/<peer id>
        ]
        first, second = LibP2PGossip(), LibP2PGossip()
        try:
            first_addresses = await first.start()
            second_addresses = await second.start()
            # unreachable addresses are given up (per-dial timeouts), never waited on forever; the bound is a
            # hang guard far above any loaded machine's dial time, not a speed check
            assert await asyncio.wait_for(first.connect(unreachable + first_addresses), timeout=300) == 0
            assert await first.connect(second_addresses * 2 + unreachable) == 1
            assert await first.connect(second_addresses) == 0  # already connected
            assert await second.connect(first_addresses) == 0  # already connected the other way
            assert (first.peer_count(), second.peer_count()) == (1, 1)
        finally:
            await asyncio.gather(first.stop(), second.stop())

    asyncio.run(scenario())


def test_a_fixed_port_in_use_is_refused():
    """py-libp2p listens with SO_REUSEPORT: without a check, both nodes would share the port."""

    async def scenario():
        first = LibP2PGossip()
        try:
            (address, *_) = await first.start()
            port = int(address.split("/tcp/")[1].split("/")[0])
            with pytest.raises(OSError, match="in use"):
                await LibP2PGossip(listen_port=port).start()
        finally:
            await first.stop()
        assert gossip_threads() == []

    asyncio.run(scenario())


def test_seed_gives_a_deterministic_peer_id():
    async def peer_id(seed: bytes | None) -> str:
        node = LibP2PGossip(seed=seed)
        try:
            (address, *_) = await node.start()
        finally:
            await node.stop()
        return address.rsplit("/p2p/", 1)[1]

    async def scenario():
        seed = bytes(range(32))
        assert await peer_id(seed) == await peer_id(seed)
        assert await peer_id(None) != await peer_id(None)

    asyncio.run(scenario())
    with pytest.raises(ValueError):
        LibP2PGossip(seed=b"short")


def test_a_restarted_peer_with_the_same_key_is_still_heard():
    """Same seed, same peer id: its new messages must not collide with the seen-cache of its old ones."""

    async def scenario():
        seed = bytes(32)
        listener = LibP2PGossip()
        restarted = None
        try:
            listener_addresses = await listener.start()
            await listener.subscribe(TOPIC)
            async with swarm(1, seed=seed) as (first_life,):
                assert await first_life.connect(listener_addresses) == 1
                await wait_for_mesh([first_life, listener], TOPIC)
                for k in range(30):
                    await first_life.publish(TOPIC, f"first-life/{k}".encode())
                assert len(await collect(listener, 30, [first_life])) == 30
            await wait_until(lambda: listener.peer_count() == 0, "the listener to see the peer go")
            restarted = LibP2PGossip(seed=seed)
            await restarted.start()
            await restarted.subscribe(TOPIC)
            assert await restarted.connect(listener_addresses) == 1
            await wait_for_mesh([restarted, listener], TOPIC)
            for k in range(10):
                await restarted.publish(TOPIC, f"second-life/{k}".encode())
            assert await collect(listener, 10, [restarted]) == [f"second-life/{k}".encode() for k in range(10)]
        finally:
            await asyncio.gather(listener.stop(), *([restarted.stop()] if restarted else []))

    asyncio.run(scenario())


def test_stop_joins_the_thread_and_leaves_nothing_running():
    threads_before = set(threading.enumerate())

    async def scenario():
        async with swarm(2) as (first, second):
            assert len(gossip_threads()) == 2 and second.running
            await second.stop()  # the dialer: the connection's socket is its to close
            assert not second.running and second.failure is None
            assert second.peer_count() == 0
            await wait_until(lambda: first.peer_count() == 0, "the peer to see the connection close")
            with pytest.raises(RuntimeError):
                await second.publish(TOPIC, b"after stop")
            await second.stop()  # a second stop is harmless
        assert gossip_threads() == []

    asyncio.run(scenario())
    leftover = [t.name for t in set(threading.enumerate()) - threads_before if t.is_alive()]
    assert leftover == [], f"threads left running: {leftover}"


def test_hivemind_and_libp2p_protobufs_coexist_in_this_process():
    from hivemind.proto import crypto_pb2 as hivemind_crypto
    from libp2p.crypto.pb import crypto_pb2 as libp2p_crypto

    assert (
        hivemind_crypto.PublicKey.DESCRIPTOR.full_name
        == libp2p_crypto.PublicKey.DESCRIPTOR.full_name
        == "crypto.pb.PublicKey"
    )
    for module in (hivemind_crypto, libp2p_crypto):
        key = module.PublicKey(key_type=module.KeyType.Value("Ed25519"), data=b"\x01" * 32)
        assert module.PublicKey.FromString(key.SerializeToString()) == key
    assert import_hivemind_isolated() is sys.modules["hivemind"]  # idempotent


def run_python(code: str) -> subprocess.CompletedProcess:
    """Run code in a fresh interpreter in its own process group; kill that group if it overruns."""
    process = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=SUBPROCESS_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # the child and any p2pd it started
        output, _ = process.communicate()
        pytest.fail(f"subprocess overran {SUBPROCESS_TIMEOUT_S:.0f}s:\n{output[-4000:]}")
    return subprocess.CompletedProcess(process.args, process.returncode, output, None)


def test_shim_lets_a_hivemind_dht_and_libp2p_gossip_share_a_process():
    result = run_python(
        """
        import asyncio
        from node.transport.protobuf_shim import import_hivemind_isolated

        hivemind = import_hivemind_isolated()
        assert import_hivemind_isolated() is hivemind
        import hivemind
        from hivemind.dht.node import DHTNode
        from hivemind.utils import get_dht_time
        import libp2p
        from node.transport.gossip_libp2p import LibP2PGossip

        async def main():
            first = await DHTNode.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
            second = None
            sender, receiver = LibP2PGossip(), LibP2PGossip()
            try:
                maddrs = [str(a) for a in await first.get_visible_maddrs()]
                second = await DHTNode.create(initial_peers=maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
                assert await first.store("shim-test", b"stored", get_dht_time() + 60)
                found = await second.get("shim-test", latest=True)
                assert found is not None and found.value == b"stored", found
                print("DHT OK")
                await sender.start()
                receiver_addresses = await receiver.start()
                await sender.subscribe("t")
                await receiver.subscribe("t")
                assert await sender.connect(receiver_addresses) == 1
                for _ in range(200):  # until the meshes form: 10 s at most
                    await sender.publish("t", b"hello")
                    await asyncio.sleep(0.05)
                    if receiver.drain("t"):
                        break
                else:
                    raise AssertionError("no gossip message arrived")
                print("GOSSIP OK")
            finally:
                await asyncio.gather(sender.stop(), receiver.stop())
                await asyncio.gather(*(node.shutdown() for node in (first, second) if node is not None))

        asyncio.run(main())
        print("ALL OK")
        """
    )
    assert result.returncode == 0 and "ALL OK" in result.stdout, result.stdout[-4000:]


def test_shim_works_after_libp2p_was_imported():
    result = run_python(
        """
        import trio, multiaddr
        from libp2p import new_host
        from node.transport.protobuf_shim import import_hivemind_isolated

        import_hivemind_isolated()
        from hivemind.dht.node import DHTNode
        from hivemind.proto import dht_pb2

        async def host_up():
            host = new_host(listen_addrs=[multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")])
            async with host.run(listen_addrs=[multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]):
                assert host.get_addrs()

        trio.run(host_up)
        request = dht_pb2.PingRequest(validate=True)
        assert dht_pb2.PingRequest.FromString(request.SerializeToString()) == request
        print("ALL OK")
        """
    )
    assert result.returncode == 0 and "ALL OK" in result.stdout, result.stdout[-4000:]


def test_shim_refuses_when_hivemind_was_imported_without_it():
    result = run_python(
        """
        import hivemind
        from node.transport.protobuf_shim import import_hivemind_isolated

        try:
            import_hivemind_isolated()
        except RuntimeError as exc:
            assert "before" in str(exc), exc
            print("REFUSED")
        """
    )
    assert result.returncode == 0 and "REFUSED" in result.stdout, result.stdout[-4000:]


def test_libp2p_chatter_goes_to_the_log_file_not_the_console(tmp_path):
    import io
    import logging

    from rich.console import Console

    import node.transport.gossip_libp2p  # noqa: F401  (imports py-libp2p, which turns its loggers' propagation off)
    from node.runtime import setup_logging

    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    screen = io.StringIO()
    try:
        setup_logging(tmp_path, verbose=False, console=Console(file=screen, width=200))
        logging.getLogger("libp2p.pubsub.gossipsub").warning("GRAFT flood detected from peer X")
        logging.getLogger("node.transport.dht").warning("heartbeat not published")
        logging.getLogger("libp2p.transport.tcp.tcp").error("Failed to open TCP stream: all attempts to connect failed")
        logging.getLogger("node.transport.gossip_libp2p").error("gossip thread died")
        for handler in root.handlers:
            handler.flush()
    finally:
        for handler in root.handlers:
            handler.close()
        root.handlers[:], _ = saved
        root.setLevel(saved[1])
    shown, logged = screen.getvalue(), (tmp_path / "node.log").read_text()
    assert "heartbeat not published" in shown and "gossip thread died" in shown
    assert "GRAFT flood" not in shown and "Failed to open TCP stream" not in shown
    assert "GRAFT flood" in logged and "Failed to open TCP stream" in logged


def test_the_peerstore_cleanup_survives_peers_that_went_away():
    """py-libp2p's own periodic cleanup raised 'peer ID is expired' for a departed peer that had left a
    signed record, which ended the host and stopped the node (the lab's churn run). The gossip host's
    peerstore drops such a record instead."""
    import multiaddr
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.peer.id import ID
    from libp2p.peer.peerstore import PeerStore, PeerStoreError

    from node.transport.gossip_libp2p import LibP2PGossip, tolerate_expired_peers

    def departed(peerstore: PeerStore) -> ID:
        peer = ID.from_pubkey(create_new_key_pair().public_key)
        peerstore.add_addrs(peer, [multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/1")], ttl=1)
        peerstore.peer_record_map[peer] = object()  # what a peer's signed record leaves behind
        return peer

    as_shipped, tolerant = PeerStore(), PeerStore()
    tolerate_expired_peers(tolerant)
    peers = [departed(as_shipped), departed(tolerant)]
    stores = (as_shipped, tolerant)
    # both addresses expire (TTLs are whole seconds: within 2 s of the clock)
    asyncio.run(
        wait_until(
            lambda: all(store.peer_data_map[peer].is_expired() for store, peer in zip(stores, peers, strict=True)),
            "both peers' addresses to expire",
            timeout=60,
            interval=0.05,
        )
    )
    with pytest.raises(PeerStoreError):
        as_shipped._cleanup_expired_records()  # the py-libp2p behaviour this guards against
    tolerant._cleanup_expired_records()
    assert peers[1] not in tolerant.peer_record_map and peers[1] not in tolerant.peer_data_map

    async def host_is_guarded() -> bool:
        gossip = LibP2PGossip()
        await gossip.start()
        try:
            return gossip._host.get_peerstore().maybe_delete_peer_record.__qualname__.startswith(
                "tolerate_expired_peers"
            )
        finally:
            await gossip.stop()

    assert asyncio.run(host_is_guarded())
