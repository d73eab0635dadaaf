"""Reaching a partner whose first dial failed: libp2p's dial backoff.

After a dial that failed, go-libp2p refuses every redial of that address for a while (5 s at first)
with "dial backoff", without dialing. In the lab, under load, a partner's first dial failed and the
next poll's call, 3 ms later, was refused so: two "failed" calls, the partner given up, and a pair
that was reachable seconds later never formed (test_lab.py::test_noloco_pairs_form_between_namespaces,
6 of 8 peer-rounds). The daemons here are real (127.0.0.1); the failed dial and the backoff are
played by `FirstDialFails`, in p2pd's own words.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
from hivemind.p2p.p2p_daemon_bindings.utils import ControlFailure

from node.averaging.exchange import WeightExchange, refused_by_dial_backoff
from node.averaging.matchmaking import MAX_DIAL_BACKOFFS, Round
from node.transport import hivemind_p2p
from tests.helpers.averaging import averagers, ordered_identities, swarm, weights

PEER = "12D3KooWA9AQUkS23kqAmLtzpvjBtCKW3WCXiqXr3WtS5jXLXUic"
# p2pd's errors as the lab's workers logged them (2026-11-26)
DIAL_FAILED = (
    f"Connect failed. msg=failed to dial: failed to dial {PEER}: all dials failed\n"
    "  * [/ip4/198.18.1.2/tcp/33649] failed to negotiate security protocol: error reading handshake message: EOF"
)
IN_BACKOFF = (
    f"Connect failed. msg=failed to dial: failed to dial {PEER}: all dials failed\n"
    "  * [/ip4/198.18.1.1/tcp/38423] dial backoff"
)
REFUSED_AND_IN_BACKOFF = (
    f"Connect failed. msg=failed to dial: failed to dial {PEER}: all dials failed\n"
    "  * [/ip4/198.18.1.3/tcp/44779] dial tcp4 198.18.1.3:44779: connect: connection refused\n"
    "  * [/ip4/127.0.0.1/tcp/44779] dial backoff"
)


REAL_CONNECT = hivemind_p2p.connect


async def connect_faked(p2p, peer, addresses) -> None:
    """`hivemind_p2p.connect` (how `node.transport.framing.open_stream` dials), with a daemon faked here dialing as
    it says (its `connect`); a real daemon dials for real."""
    if isinstance(p2p, (FirstDialFails, NoRouteThenBackoff)):
        return await p2p.connect(peer, addresses)
    return await REAL_CONNECT(p2p, peer, addresses)


class FirstDialFails:
    """A node's p2p daemon, not yet connected to its partners: a stream needs a dial first (`connect_faked` stands in
    for `hivemind_p2p.connect`), the first dial fails, and every dial within `backoff_s` of it is refused with "dial
    backoff", as go-libp2p's swarm does; later dials and streams are the real daemon's."""

    def __init__(self, p2p, backoff_s: float) -> None:
        self.p2p = p2p
        self.backoff_s = backoff_s
        self.dials: list[str] = []  # the outcome of each dial: "failed", "backoff", "connected"
        self._failed_at: float | None = None

    def __getattr__(self, name):
        return getattr(self.p2p, name)

    async def connect(self, peer, addresses) -> None:
        now = asyncio.get_running_loop().time()
        if self._failed_at is None:
            self._failed_at = now
            self.dials.append("failed")
            raise ControlFailure(DIAL_FAILED)
        if now < self._failed_at + self.backoff_s:
            self.dials.append("backoff")
            raise ControlFailure(IN_BACKOFF)
        await REAL_CONNECT(self.p2p, peer, addresses)
        self.dials.append("connected")

    async def call_binary_stream_handler(self, peer, handler):
        if "connected" not in self.dials:
            raise ControlFailure("Connect failed. msg=routing: not found")
        return await self.p2p.call_binary_stream_handler(peer, handler)


def test_dial_backoff_is_told_from_a_failed_dial():
    assert refused_by_dial_backoff(ControlFailure(IN_BACKOFF))
    assert refused_by_dial_backoff(ControlFailure("Connect failed. msg=failed to dial: dial backoff"))
    assert not refused_by_dial_backoff(ControlFailure(DIAL_FAILED))
    # one address was dialed (and refused): the peer was tried
    assert not refused_by_dial_backoff(ControlFailure(REFUSED_AND_IN_BACKOFF))
    assert not refused_by_dial_backoff(ControlFailure("Connect failed. msg=routing: not found"))
    assert not refused_by_dial_backoff(OSError("dial backoff"))  # only p2pd's refusals


def test_a_call_refused_by_dial_backoff_waits_for_it_and_is_not_a_failed_exchange():
    """Each call into the backoff is counted as such, not as a broken exchange; the peer is not called again
    before the backoff has passed, and is given up at the MAX_DIAL_BACKOFFS-th."""

    class AlwaysInBackoff:
        async def call_binary_stream_handler(self, peer, handler):
            raise ControlFailure(IN_BACKOFF)

    async def scenario():
        failures: Counter[str] = Counter()
        exchange = WeightExchange(
            AlwaysInBackoff(),
            "prefix",
            mode="fp32",
            max_relative_distance=0.5,
            dht_timeout=1.0,
            refusals=Counter(),
            failures=failures,
            dial_backoff_s=600.0,
        )
        loop = asyncio.get_running_loop()
        rnd = Round(round_id=1, theta={}, payload=b"", capacity=1, deadline=loop.time() + 1200)
        before = loop.time()
        assert await exchange.call(rnd, PEER) is False
        assert failures == {"dial_backoff": 1}
        assert PEER not in rnd.failed_calls and PEER not in rnd.given_up and not rnd.engaged
        assert rnd.retry_at[PEER] >= before + 600.0
        assert rnd.refusal_for(PEER) is None and not rnd.may_call(PEER)  # its own calls are still taken
        for _ in range(MAX_DIAL_BACKOFFS - 1):
            await exchange.call(rnd, PEER)
        assert failures == {"dial_backoff": MAX_DIAL_BACKOFFS} and PEER in rnd.given_up

    asyncio.run(scenario())


@pytest.mark.integration
def test_a_partner_whose_first_dial_failed_is_called_again_after_the_backoff(tmp_path, monkeypatch):
    """The caller's first dial fails; it calls again once the backoff has passed (one more dial, which connects)
    and the pair averages. The partner's patience outlasts the round: only the caller's retry can pair them.
    Before the fix the retry came at the next poll, was refused by the backoff, and the partner was given up."""

    backoff_s = 1.0
    monkeypatch.setattr(hivemind_p2p, "connect", connect_faked)

    def dial_fails_once(p2p, *args, **kwargs):
        return WeightExchange(FirstDialFails(p2p, backoff_s), *args, **kwargs)

    async def scenario():
        async with (
            swarm(2, ordered_identities(tmp_path, 2)) as nodes,
            averagers(nodes[:1], exchange=dial_fails_once, dial_backoff_s=backoff_s) as (caller,),
            averagers(nodes[1:], call_patience_s=60.0) as (partner,),
        ):
            assert caller.peer_id < partner.peer_id  # the lower id calls
            results = await asyncio.gather(
                caller.average(weights(0), 5, timeout=20), partner.average(weights(1), 5, timeout=20)
            )
            assert all(r is not None for r in results), (caller.failures, partner.failures)
            assert results[0].partner_ids == [partner.peer_id] and results[1].partner_ids == [caller.peer_id]
            assert caller.exchange.p2p.dials == ["failed", "connected"]
            assert caller.failures == {"exchange_failed": 1}

    asyncio.run(scenario())


class NoRouteThenBackoff:
    """A daemon with no route to the peer, whose dial is then refused in backoff: the two answers `open_stream` gets."""

    async def call_binary_stream_handler(self, peer, handler):
        raise ControlFailure("Connect failed. msg=routing: not found")

    async def connect(self, peer, addresses) -> None:
        raise ControlFailure(IN_BACKOFF)


def test_a_failed_dial_keeps_what_the_first_stream_request_was_told(monkeypatch):
    """The error `open_stream` raises after dialing is the dial's (still told apart as a backoff), and it carries
    p2pd's first answer as a note, which `stream_failure` prints beside it."""
    from node.transport.framing import open_stream, stream_failure

    monkeypatch.setattr(hivemind_p2p, "connect", connect_faked)

    async def attempt():
        await open_stream(NoRouteThenBackoff(), PEER, ["/ip4/198.18.1.1/tcp/38423"], "handler", dial_timeout=5)

    try:
        asyncio.run(attempt())
    except ControlFailure as exc:
        assert refused_by_dial_backoff(exc)
        line = stream_failure(exc)
        assert "dial backoff" in line and "before the dial, p2pd said: Connect failed. msg=routing: not found" in line
    else:
        raise AssertionError("open_stream reached a peer it cannot reach")


@pytest.mark.integration
def test_a_partner_that_has_not_started_the_round_is_called_once_per_poll(tmp_path):
    """A partner announced "free" for the round but not in it yet answers NOT_READY. The caller tries it again
    at most about once per poll interval: before, each refused call woke the matchmaker, which called again at
    once (226 calls in 2 s on loopback), a p2p stream each. The bound is counted against the time measured
    around the round, so a slow machine can only make fewer calls."""

    poll_s = 0.2

    async def scenario():
        async with (
            swarm(2, ordered_identities(tmp_path, 2)) as nodes,
            averagers(nodes[:1], poll_interval=poll_s) as (caller,),
            averagers(nodes[1:]) as (partner,),
        ):
            assert caller.peer_id < partner.peer_id  # the lower id calls
            await partner.matchmaker.announce(7, "free")  # announced, but its average() for round 7 never runs
            loop = asyncio.get_running_loop()
            began = loop.time()
            assert await caller.average(weights(0), 7, timeout=3) is None
            elapsed = loop.time() - began
            calls = caller.failures["call_refused:not_ready"]
            # retries come 0.5-1.5 poll intervals apart (jittered)
            assert 1 <= calls <= elapsed / (0.5 * poll_s) + 1, (calls, elapsed, dict(caller.failures))

    asyncio.run(scenario())
