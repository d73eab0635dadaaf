"""Faulty and hostile partners in the weight exchange (real peers on 127.0.0.1).

Faults are injected by `Fault` through `FaultyExchange`, which overrides the seams of
`WeightExchange` that decide what goes on the wire. Each fault is tried with the honest
peer in both roles (it opens the stream, or it accepts it): p2p identities are chosen so
that the role is known.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import struct
from contextlib import asynccontextmanager

import pytest
import torch

from node.averaging.exchange import Frame, WeightExchange
from node.transport.joining import shutdown_dht
from tests.helpers.averaging import assert_untouched, averagers, ordered_identities, snapshot, swarm, weights

pytestmark = pytest.mark.integration


class Fault(enum.Enum):
    NAN = "nan"
    WRONG_SHAPE = "wrong_shape"
    FAR_AWAY = "far_away"
    OVERSIZED = "oversized"
    STALL = "stall"  # sends half its weights, then nothing
    NO_DONE = "no_done"  # never sends DONE after the COMMIT frames, as if the stream broke right there
    BREAK_AFTER_COMMIT = "break_after_commit"  # sends its COMMIT, then breaks the stream before reading the partner's
    ROUND_ENDS = "round_ends"  # not hostile: its own round ends (deadline, window) while the weights move


class FaultyExchange(WeightExchange):
    def __init__(self, *args, fault: Fault, **kwargs):
        super().__init__(*args, **kwargs)
        self.fault = fault
        self.stalled = asyncio.Event()

    def outgoing(self, theta):
        if self.fault is Fault.NAN:
            return {k: v.clone().fill_(float("nan")) if k == "b" else v for k, v in theta.items()}
        if self.fault is Fault.WRONG_SHAPE:
            return {k: v.T.contiguous() if k == "w" else v for k, v in theta.items()}
        if self.fault is Fault.FAR_AWAY:
            return {k: v * 100 for k, v in theta.items()}
        if self.fault is Fault.OVERSIZED:
            return {**theta, "w": torch.zeros(4096, theta["w"].shape[1])}  # beyond the size bound of our model
        return theta

    async def send_commit(self, writer):
        sent = await super().send_commit(writer)
        if self.fault is Fault.BREAK_AFTER_COMMIT:
            await asyncio.sleep(1.0)  # lets our COMMIT arrive before the reset (usually: the test accepts either)
            writer.close()
            raise ConnectionResetError("fault: the stream broke between the two COMMIT frames")
        return sent

    async def send_done(self, writer):
        if self.fault is not Fault.NO_DONE:
            return await super().send_done(writer)
        return 0  # its DONE is lost (closing the stream here instead would race with its own COMMIT in flight)

    async def send_weights(self, writer, payload):
        if self.fault is Fault.ROUND_ENDS:
            self.close()
        if self.fault is not Fault.STALL:
            return await super().send_weights(writer, payload)
        writer.write(struct.pack(">BQ", Frame.WEIGHTS, len(payload)) + payload[: len(payload) // 2])
        await writer.drain()
        self.stalled.set()
        await asyncio.sleep(3600)  # cancelled by the round's deadline (or stop())


def faulty(fault: Fault):
    """What builds an averager's exchange that plays `fault` (PairAverager's `exchange`)."""
    return functools.partial(FaultyExchange, fault=fault)


ROLES = ["honest_calls", "honest_accepts"]


def honest_first(role: str, tmp_path) -> list[str]:
    """Identities for [honest node, faulty node]; the lower peer id opens the stream."""
    low, high = ordered_identities(tmp_path, 2)
    return [low, high] if role == "honest_calls" else [high, low]


@asynccontextmanager
async def honest_against(fault: Fault, role: str, tmp_path):
    """An honest averager and one that plays `fault`, each on its own DHT node, the honest one in `role`: yields
    (nodes, honest, faulty)."""
    async with swarm(2, honest_first(role, tmp_path)) as nodes:
        async with (
            averagers(nodes[:1]) as (honest,),
            averagers(nodes[1:], exchange=faulty(fault)) as (other,),
        ):
            yield nodes, honest, other


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("then", ["hangs", "dies"])
def test_partner_that_stops_mid_exchange_gives_none_within_the_timeout(then, role, tmp_path):
    async def scenario():
        async with honest_against(Fault.STALL, role, tmp_path) as (nodes, honest, stalling):
            assert (honest.peer_id < stalling.peer_id) == (role == "honest_calls")
            theta = weights(1)
            before = snapshot(theta)
            # long enough for the rendezvous on a loaded machine: the stall, not the DHT, must end the round
            timeout = 10.0

            async def kill_when_stalled():
                await stalling.exchange.stalled.wait()
                if then == "dies":
                    await stalling.stop(timeout=2)
                    await shutdown_dht(nodes[1], timeout=5)

            killer = asyncio.create_task(kill_when_stalled())
            result, _ = await asyncio.gather(
                honest.average(theta, 3, timeout=timeout), stalling.average(weights(2), 3, timeout=timeout)
            )
            await asyncio.wait_for(killer, 10)
            assert stalling.exchange.stalled.is_set()  # the exchange really started
            assert result is None
            if (
                then == "hangs"
                # only the round's deadline can end an exchange that stalls
                # (a dead partner's reset may end it sooner)
            ):
                assert honest.rounds_to_deadline == 1
            assert_untouched(theta, before)
            # the weights began to move: not a round without a partner (which the node would retry at once)
            assert honest.rounds_skipped == 1 and honest.failures["not_committed"] == 1
            assert honest.last_skip == "not_committed" and "no_partner" not in honest.failures

    asyncio.run(scenario())


@pytest.mark.parametrize("role", ROLES)
def test_hostile_partners_are_refused_and_counted(role, tmp_path):
    async def scenario():
        async with swarm(2, honest_first(role, tmp_path)) as nodes:
            cases = [
                (Fault.NAN, "not_finite"),
                (Fault.WRONG_SHAPE, "wrong_shape"),
                (Fault.FAR_AWAY, "too_far"),
                (Fault.OVERSIZED, "malformed"),
            ]
            for round_id, (fault, reason) in enumerate(cases):
                async with (
                    averagers(nodes[:1]) as (honest,),
                    averagers(nodes[1:], exchange=faulty(fault)) as (hostile,),
                ):
                    theta = weights(1)
                    before = snapshot(theta)
                    # a deadline no loaded machine reaches: the round must end because the partner was given up
                    result, _ = await asyncio.gather(
                        honest.average(theta, round_id, timeout=120), hostile.average(weights(2), round_id, timeout=120)
                    )
                    assert result is None, fault
                    assert honest.refusals == {reason: 1}, (fault, honest.refusals, honest.failures)
                    # the refused partner is given up: no waiting for the deadline
                    assert honest.rounds_to_deadline == 0
                    assert_untouched(theta, before)

    asyncio.run(scenario())


@pytest.mark.parametrize("role", ROLES)
def test_a_lost_done_frame_is_counted_as_an_unconfirmed_outcome(role, tmp_path):
    async def scenario():
        async with honest_against(Fault.NO_DONE, role, tmp_path) as (_, honest, broken):
            result, _ = await asyncio.gather(
                honest.average(weights(1), 5, timeout=6), broken.average(weights(2), 5, timeout=6)
            )
            assert result is not None  # it averaged, and cannot know whether its partner did: counted, not silent
            assert honest.failures["outcome_unconfirmed"] == 1
            assert broken.failures["outcome_unconfirmed"] == 0  # the honest side's DONE did arrive

    asyncio.run(scenario())


@pytest.mark.parametrize("role", ROLES)
def test_a_stream_broken_between_the_commit_frames_never_leaves_a_silent_disagreement(role, tmp_path):
    """The faulty side never reads our COMMIT, so it never averages. Our side averages iff its COMMIT
    arrived before the stream broke (p2pd may drop it with the reset): either both sides kept their own
    weights, or ours averaged alone and counted `outcome_unconfirmed`."""

    async def scenario():
        async with honest_against(Fault.BREAK_AFTER_COMMIT, role, tmp_path) as (_, honest, broken):
            theta = weights(1)
            before = snapshot(theta)
            result, broken_result = await asyncio.gather(
                honest.average(theta, 5, timeout=6), broken.average(weights(2), 5, timeout=6)
            )
            assert broken_result is None and broken.failures["exchange_failed"] >= 1
            assert_untouched(theta, before)
            if result is not None and result.partner_ids:
                assert honest.failures["outcome_unconfirmed"] == 1  # averaged alone: counted, not silent
            else:
                assert honest.failures["outcome_unconfirmed"] == 0 and honest.failures["exchange_failed"] >= 1
            print(f"honest side averaged: {result is not None}; failures {dict(honest.failures)}")

    asyncio.run(scenario())


@pytest.mark.parametrize("role", ROLES)
def test_a_round_that_ends_while_the_weights_move_commits_to_nobody(role, tmp_path):
    """A round closed mid-exchange (its deadline, or the end of its window as a call came in) commits nothing, so its
    partner must not average either: it is told so instead of a COMMIT."""

    async def scenario():
        async with honest_against(Fault.ROUND_ENDS, role, tmp_path) as (_, honest, ending):
            theta = weights(1)
            before = snapshot(theta)
            result, ending_result = await asyncio.gather(
                honest.average(theta, 5, timeout=60), ending.average(weights(2), 5, timeout=60)
            )
            assert ending_result is None and ending.failures["round_closed_before_commit"] == 1, ending.failures
            # the answer is a REFUSE, unless the closed stream's reset overtakes it in p2pd: either way, no average
            assert result is None, honest.failures
            assert honest.failures["partner_refused_our_weights"] + honest.failures["exchange_failed"] == 1
            assert_untouched(theta, before)

    asyncio.run(scenario())
