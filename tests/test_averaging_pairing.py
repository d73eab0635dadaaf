"""The weight exchange between real, honest peers on 127.0.0.1 (in-process DHT nodes, one p2pd each).

Its peers come from tests/helpers/averaging.py.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from node.averaging.matchmaking import CallRefusal, Round, pair_partner
from node.averaging.pairing import PairAverager
from node.transport.joining import shutdown_dht
from tests.helpers.averaging import (
    OTHER_PREFIX,
    GainsARelayAddress,
    PREFIX,
    assert_untouched,
    averagers,
    make_writer,
    ordered_identities,
    snapshot,
    swarm,
    weights,
    writer_losing_done_announcements,
    writer_slow_to_announce_done,
)
from tests.helpers.swarm import SWARM_OVERRIDES, wait_for_async

pytestmark = pytest.mark.integration

# A round that pairs returns as soon as its exchange ends, so a generous deadline costs a passing run nothing; a starved
# CI machine (two cores shared with a soak) has needed more than 15 s for the DHT rendezvous of two peers.
PAIRED_WITHIN_S = 60


def test_two_peers_get_exactly_the_mean_fp32():
    async def scenario():
        async with swarm(2) as nodes, averagers(nodes) as (a, b):
            theta_a, theta_b = weights(1), weights(2)
            before_a, before_b = snapshot(theta_a), snapshot(theta_b)
            called = time.perf_counter()
            result_a, result_b = await asyncio.gather(
                a.average(theta_a, 7, timeout=PAIRED_WITHIN_S), b.average(theta_b, 7, timeout=PAIRED_WITHIN_S)
            )
            around = time.perf_counter() - called
            assert result_a is not None and result_b is not None, (a.failures, b.failures)
            assert result_a.partner_ids == [b.peer_id] and result_b.partner_ids == [a.peer_id]
            for name in theta_a:
                expected = (theta_a[name] + theta_b[name]) / 2
                assert torch.equal(result_a.mean_theta[name], expected)
                assert torch.equal(result_b.mean_theta[name], expected)
            assert_untouched(theta_a, before_a)
            assert_untouched(theta_b, before_b)
            payload = 4 * (16 * 8 + 8)
            assert payload < result_a.bytes_sent < payload + 1024 and payload < result_a.bytes_received < payload + 1024
            # each result times its own call, from average() to the result: inside the time taken around both
            assert 0 < result_a.seconds <= around and 0 < result_b.seconds <= around
            assert result_a.round_id == 7 and result_a.group_size == 2
            assert a.refusals == {} and b.refusals == {} and a.rounds_averaged == 1

    asyncio.run(scenario())


def test_two_peers_fp16_within_half_precision_error():
    async def scenario():
        async with swarm(2) as nodes, averagers(nodes, mode="fp16") as (a, b):
            theta_a, theta_b = weights(1), weights(2)
            result_a, result_b = await asyncio.gather(
                a.average(theta_a, 1, timeout=PAIRED_WITHIN_S), b.average(theta_b, 1, timeout=PAIRED_WITHIN_S)
            )
            assert result_a is not None and result_b is not None
            for name in theta_a:
                expected = (theta_a[name] + theta_b[name]) / 2
                # only the partner's half travelled in float16 (relative error <= 2^-11, halved by the mean)
                for result, partner in ((result_a, theta_b), (result_b, theta_a)):
                    assert torch.all((result.mean_theta[name] - expected).abs() <= partner[name].abs() * 2**-12 + 1e-7)
            assert result_a.bytes_sent < 3 * (16 * 8 + 8) + 1024  # half of fp32's 4 bytes per value, plus framing

    asyncio.run(scenario())


def test_four_peers_form_pairs():
    async def scenario():
        async with swarm(4) as nodes, averagers(nodes) as group:
            thetas = [weights(i) for i in range(4)]
            for round_id in (0, 1):
                results = await asyncio.gather(
                    *(avg.average(theta, round_id, timeout=PAIRED_WITHIN_S) for avg, theta in zip(group, thetas))
                )
                assert all(r is not None for r in results), [a.failures for a in group]
                by_id = {avg.peer_id: (theta, result) for avg, theta, result in zip(group, thetas, results)}
                for peer, (theta, result) in by_id.items():
                    assert len(result.partner_ids) == 1
                    partner = result.partner_ids[0]
                    partner_theta, partner_result = by_id[partner]
                    assert partner_result.partner_ids == [peer]  # pairs are mutual: nobody averaged twice
                    for name in theta:
                        assert torch.equal(result.mean_theta[name], (theta[name] + partner_theta[name]) / 2)

    asyncio.run(scenario())


def test_a_peer_alone_in_its_window_stops_looking_when_the_window_ends_and_pairs_in_the_next():
    """With `find_within` (what is left of the caller's time window) a round nobody else joined ends there, not at
    the deadline: later peers look in the next window's round, where both then meet."""

    async def scenario():
        async with swarm(2) as nodes, averagers(nodes) as (a, b):
            assert await a.average(weights(1), 5, timeout=60, find_within=1.0) is None
            assert a.failures["no_partner_in_window"] == 1 and "no_partner" not in a.failures, a.failures
            assert a.rounds_to_deadline == 0 and a.rounds_skipped == 1
            result_a, result_b = await asyncio.gather(
                a.average(weights(1), 6, timeout=60, find_within=30),
                b.average(weights(2), 6, timeout=60, find_within=30),
            )
            assert result_a is not None and result_b is not None, (a.failures, b.failures)
            assert result_a.partner_ids == [b.peer_id] and result_b.partner_ids == [a.peer_id]

    asyncio.run(scenario())


def test_a_round_past_its_search_closes_at_once_so_no_late_caller_is_taken():
    async def scenario():
        now = asyncio.get_running_loop().time()

        def round_(find_by):
            return Round(round_id=1, theta={}, payload=b"", capacity=1, deadline=now + 60, find_by=find_by)

        over = round_(now - 1)
        assert over.refusal_for("late-caller") is None
        assert over.past_search() and over.closed and over.search_ended
        assert over.refusal_for("late-caller") is CallRefusal.FINISHED
        busy = round_(now - 1)
        busy.engaged.add("partner")  # an exchange in flight finishes: only its deadline ends it
        assert not busy.past_search() and not busy.closed
        assert not round_(now + 60).past_search() and not round_(None).past_search()

    asyncio.run(scenario())


def test_a_stale_free_announcement_does_not_idle_its_partner_to_the_deadline(tmp_path):
    """A peer ended its round but its "done" never reached the DHT (a store that timed out on a loaded
    machine; seen in the lab: two of four peers idled to the deadline). Its stale "free" still pairs
    it, in everyone's view, with a peer whose id is higher, who would wait forever for its call. That
    peer calls it after call_patience_s, gets FINISHED, gives it up, and pairs with the third peer."""

    async def scenario():
        async with (
            swarm(3, ordered_identities(tmp_path, 3)) as nodes,
            averagers(nodes, writers=[writer_losing_done_announcements()]) as group,
        ):
            stale = group[0]  # lowest id: its partner is the higher id, the side that waits for a call
            assert stale.peer_id == min(avg.peer_id for avg in group)
            ids = [avg.peer_id for avg in group]
            # a round in which it is not the odd one out
            round_id = next(r for r in range(1000) if pair_partner(ids, stale.peer_id, r) is not None)
            # alone: it ends the round, still "free" in the DHT
            assert await stale.average(weights(0), round_id, timeout=1.0) is None
            waiting = next(avg for avg in group if avg.peer_id == pair_partner(ids, stale.peer_id, round_id))
            third = next(avg for avg in group if avg is not waiting and avg is not stale)
            results = await asyncio.gather(
                waiting.average(weights(1), round_id, timeout=30), third.average(weights(2), round_id, timeout=30)
            )
            assert all(r is not None for r in results), [avg.failures for avg in group]
            assert results[0].partner_ids == [third.peer_id] and results[1].partner_ids == [waiting.peer_id]
            assert waiting.failures["call_refused:finished"] == 1 and waiting.rounds_to_deadline == 0

    asyncio.run(scenario())


def test_a_peer_that_stops_right_after_its_round_is_done_in_its_peers_view():
    """A node that leaves right after a round (the lab's workers after their last one) must not stay "free" in its
    peers' views: they would dial a dead daemon and wait out libp2p's dial backoff. stop() lets the round's "done"
    announcement land first, even when the store is slow."""
    from protocol import MessageKind

    from node.transport.records import read_records

    async def scenario():
        async with (
            swarm(2) as nodes,
            averagers(nodes, writers=[writer_slow_to_announce_done(1.0)]) as (leaving, staying),
        ):
            results = await asyncio.gather(
                leaving.average(weights(1), 3, timeout=PAIRED_WITHIN_S),
                staying.average(weights(2), 3, timeout=PAIRED_WITHIN_S),
            )
            assert all(r is not None for r in results), (leaving.failures, staying.failures)
            await leaving.stop(timeout=10)
            key = staying.matchmaker.ready_key(3)
            envelopes = await read_records(
                nodes[1], key, staying.matchmaker.writer.swarm_id, MessageKind.AVERAGING_READY, 5.0, 16, lambda *_: None
            )
            states = {e.message.p2p_peer_id: e.message.state for e in envelopes}
            assert states.get(leaving.peer_id) == "done", states

    asyncio.run(scenario())


def test_all_mode_calls_a_lower_id_whose_free_announcement_went_stale(tmp_path):
    """All mode: the lowest id ended its round, but only its "free" reached the DHT. The two others wait
    for calls from lower ids, so without a call of their own they would idle to the deadline (as the
    lab's DiLoCo rounds at N = 16 did, there waiting on lower ids slow to call). They call it after the
    gather window and call_patience_s, get FINISHED, and average with each other."""

    async def scenario():
        async with (
            swarm(3, ordered_identities(tmp_path, 3)) as nodes,
            averagers(nodes, group_size=None, writers=[writer_losing_done_announcements()]) as group,
        ):
            stale = group[0]
            assert stale.peer_id == min(avg.peer_id for avg in group)
            assert await stale.average(weights(0), 3, timeout=1.0) is None
            others = [avg for avg in group if avg is not stale]
            results = await asyncio.gather(
                *(avg.average(weights(i + 1), 3, timeout=60) for i, avg in enumerate(others))
            )
            assert all(r is not None and r.group_size == 2 for r in results), [avg.failures for avg in group]
            for avg in others:
                assert avg.failures["call_refused:finished"] == 1 and avg.rounds_to_deadline == 0, avg.failures

    asyncio.run(scenario())


def test_pair_order_is_agreed_and_changes_with_the_round():
    peers = [f"peer-{i}" for i in range(6)]
    partners = {round_id: {p: pair_partner(peers, p, round_id) for p in peers} for round_id in range(20)}
    for mapping in partners.values():
        assert all(mapping[mapping[p]] == p and mapping[p] != p for p in peers)
    assert len({tuple(sorted(m.items())) for m in partners.values()}) > 1  # new partners across rounds
    odd = [p for p in ["a", "b", "c"] if pair_partner(["a", "b", "c"], p, 3) is None]
    assert len(odd) == 1  # the odd one out skips


def test_all_live_peers_mode_gives_everyone_the_same_mean():
    async def scenario():
        async with swarm(3) as nodes, averagers(nodes, group_size=None) as group:
            thetas = [weights(i) for i in range(3)]
            results = await asyncio.gather(
                *(avg.average(theta, 5, timeout=PAIRED_WITHIN_S) for avg, theta in zip(group, thetas))
            )
            assert all(r is not None and r.group_size == 3 for r in results), [a.failures for a in group]
            for name in thetas[0]:
                for result in results:
                    assert torch.equal(result.mean_theta[name], results[0].mean_theta[name])  # bit-identical
                torch.testing.assert_close(
                    results[0].mean_theta[name], sum(t[name] for t in thetas) / 3, rtol=1e-6, atol=1e-6
                )

    asyncio.run(scenario())


def test_different_fingerprints_are_never_paired():
    async def scenario():
        async with swarm(3) as nodes, averagers(nodes, prefixes=[PREFIX, PREFIX, OTHER_PREFIX]) as (x1, x2, other):
            thetas = [weights(i) for i in range(3)]
            # a deadline a loaded machine's rendezvous fits in; `other` waits it out alone
            results = await asyncio.gather(
                *(avg.average(theta, 0, timeout=10) for avg, theta in zip((x1, x2, other), thetas))
            )
            assert results[0].partner_ids == [x2.peer_id] and results[1].partner_ids == [x1.peer_id]
            assert results[2] is None and other.rounds_to_deadline == 1
            assert other.failures == {"no_partner": 1} and other.refusals == {}
            # even a deliberate call across models is turned away: x1 serves no exchange under the other prefix
            from hivemind.p2p import P2PDaemonError, P2PHandlerError

            from node.transport.framing import open_stream

            # alone in its round, x1 keeps it open to the timeout: long enough to be seen open on a loaded machine
            other_round = asyncio.create_task(x1.average(thetas[0], 1, timeout=5))
            await wait_for_async(lambda: x1.exchange.round is not None, 10, "x1's round to open")
            with pytest.raises((P2PDaemonError, P2PHandlerError)):
                await open_stream(nodes[2].p2p, x1.peer_id, [], other.exchange.handler_name, 5)
            assert await other_round is None

    asyncio.run(scenario())


def test_average_requires_start_and_rounds_do_not_overlap():
    async def scenario():
        async with swarm(1) as nodes:
            idle = PairAverager(nodes[0], PREFIX, writer=make_writer())
            with pytest.raises(RuntimeError, match="start"):
                await idle.average(weights(0), 0, timeout=1)
            async with averagers(nodes) as (alone,):
                first = asyncio.create_task(alone.average(weights(0), 0, timeout=5))
                await wait_for_async(lambda: alone.exchange.round is not None, 10, "the first round to open")
                with pytest.raises(RuntimeError, match="already running"):
                    await alone.average(weights(0), 0, timeout=1)
                assert await first is None  # alone in the swarm: skipped at the timeout
                broken = weights(0)
                broken["b"][0] = float("nan")
                assert await alone.average(broken, 1, timeout=5) is None  # never offered to a partner
                assert alone.failures["own_weights_not_finite"] == 1 and alone.rounds_skipped == 2

    asyncio.run(scenario())


def test_each_free_announcement_carries_the_addresses_the_session_has_then(tiny_config):
    """A partner dials this node at the addresses it announced "free" with: a relay address the session gains after
    averaging started (a relay that reserved a slot late, or came back after a restart; the session's membership
    refreshes its addresses, node/transport/membership.py) must reach the next round's announcement."""
    from node.averaging.service import start_averaging
    from node.transport.session import SwarmSession
    from protocol import NodeIdentity

    config = tiny_config(*SWARM_OVERRIDES, "averaging.method=noloco")

    async def announced(averager: PairAverager, round_id: int) -> list[str]:
        """The addresses a peer reads in this node's "free" announcement of the round."""
        await averager.matchmaker.announce(round_id, "free")
        rnd = Round(round_id=round_id, theta={}, payload=b"", capacity=1, deadline=0.0)
        await averager.matchmaker.read_view(rnd)
        return rnd.addresses[averager.peer_id]

    async def scenario():
        async with swarm(2) as (node, relay_node):
            daemon = GainsARelayAddress(node)
            session = SwarmSession(
                config, daemon, "outbound-only", NodeIdentity.generate(), config.resolved_state_dir()
            )
            await session.refresh_addresses()  # as join_swarm does
            service = await start_averaging(config, session, torch.nn.Linear(2, 2), "fingerprint", 0)
            try:
                assert await announced(service.averager, 0) == session.addresses
                relay, ours = relay_node.peer_id.to_base58(), node.peer_id.to_base58()
                daemon.relay = [f"/ip4/10.0.0.9/tcp/4001/p2p/{relay}/p2p-circuit/p2p/{ours}"]
                assert await session.refresh_addresses()  # what the membership does every heartbeat
                assert daemon.relay[0] in session.addresses
                assert await announced(service.averager, 1) == session.addresses
            finally:
                await service.averager.stop()

    asyncio.run(scenario())


def test_a_stream_reaches_an_unconnected_peer_through_its_announced_addresses():
    """Two p2p daemons that never met: p2pd finds no route to a bare peer id ("routing: not found"),
    which is what broke NoLoCo pairs and pipeline calls between hosts (peers on one host are soon
    connected through DHT traffic, so loopback swarms never showed it). With the addresses a peer
    announces, the stream opens."""
    from hivemind.dht.node import DHTNode
    from hivemind.p2p import P2PDaemonError

    from node.transport.framing import open_stream

    handler = "swarm-node/test/echo"

    async def echo(_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(await reader.readexactly(5))
        await writer.drain()
        writer.close()

    async def scenario():
        caller = await DHTNode.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        server = await DHTNode.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])  # no initial peers: the two never met
        try:
            await server.p2p.add_binary_stream_handler(handler, echo)
            server_id = server.peer_id.to_base58()
            with pytest.raises(P2PDaemonError):
                await open_stream(caller.p2p, server_id, [], handler, dial_timeout=10)
            maddrs = [str(a) for a in await server.get_visible_maddrs()]
            reader, writer = await open_stream(
                caller.p2p, server_id, ["not a multiaddr", *maddrs], handler, dial_timeout=10
            )
            writer.write(b"hello")
            await writer.drain()
            assert await reader.readexactly(5) == b"hello"
            writer.close()
        finally:
            await asyncio.gather(shutdown_dht(caller, timeout=10), shutdown_dht(server, timeout=10))

    asyncio.run(scenario())


def test_averaging_announcements_carry_the_daemon_addresses():
    async def scenario():
        async with swarm(2) as nodes, averagers(nodes) as (a, b):
            theta_a, theta_b = weights(1), weights(2)
            await asyncio.gather(
                a.average(theta_a, 3, timeout=PAIRED_WITHIN_S), b.average(theta_b, 3, timeout=PAIRED_WITHIN_S)
            )
            view_round = Round(round_id=3, theta={}, payload=b"", capacity=1, deadline=0.0)
            view = await a.matchmaker.read_view(view_round)
            assert set(view) == {a.peer_id, b.peer_id}
            assert view_round.addresses[b.peer_id] == [str(m) for m in await nodes[1].get_visible_maddrs()]

    asyncio.run(scenario())
