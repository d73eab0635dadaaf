"""Faulty and hostile partners in the weight exchange (real peers on 127.0.0.1).

Faults are injected by `Fault` through `FaultyAverager`, which overrides the two seams of
`PairAverager` that decide what goes on the wire. Each fault is tried with the honest
peer in both roles (it opens the stream, or it accepts it): p2p identities are chosen so
that the role is known.
"""

from __future__ import annotations

import asyncio
import enum
import struct
import time

import pytest
import torch

from node.averaging.pairing import Frame, PairAverager
from node.transport.dht import shutdown_dht
from tests.test_averaging_pairing import assert_untouched, averagers, ordered_identities, snapshot, swarm, weights


class Fault(enum.Enum):
    NAN = "nan"
    WRONG_SHAPE = "wrong_shape"
    FAR_AWAY = "far_away"
    OVERSIZED = "oversized"
    STALL = "stall"  # sends half its weights, then nothing
    NO_DONE = "no_done"  # never sends DONE after the COMMIT frames, as if the stream broke right there


class FaultyAverager(PairAverager):
    def __init__(self, *args, fault: Fault, **kwargs):
        super().__init__(*args, **kwargs)
        self.fault = fault
        self.stalled = asyncio.Event()

    def _outgoing(self, theta):
        if self.fault is Fault.NAN:
            return {k: v.clone().fill_(float("nan")) if k == "b" else v for k, v in theta.items()}
        if self.fault is Fault.WRONG_SHAPE:
            return {k: v.T.contiguous() if k == "w" else v for k, v in theta.items()}
        if self.fault is Fault.FAR_AWAY:
            return {k: v * 100 for k, v in theta.items()}
        if self.fault is Fault.OVERSIZED:
            return {**theta, "w": torch.zeros(4096, theta["w"].shape[1])}  # beyond the size bound of our model
        return theta

    async def _send_done(self, writer):
        if self.fault is not Fault.NO_DONE:
            return await super()._send_done(writer)
        return 0  # its DONE is lost (closing the stream here instead would race with its own COMMIT in flight)

    async def _send_weights(self, writer, payload):
        if self.fault is not Fault.STALL:
            return await super()._send_weights(writer, payload)
        writer.write(struct.pack(">BQ", Frame.WEIGHTS, len(payload)) + payload[: len(payload) // 2])
        await writer.drain()
        self.stalled.set()
        await asyncio.sleep(3600)  # cancelled by the round's deadline (or stop())


ROLES = ["honest_calls", "honest_accepts"]


def honest_first(role: str, tmp_path) -> list[str]:
    """Identities for [honest node, faulty node]; the lower peer id opens the stream."""
    low, high = ordered_identities(tmp_path, 2)
    return [low, high] if role == "honest_calls" else [high, low]


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("then", ["hangs", "dies"])
def test_partner_that_stops_mid_exchange_gives_none_within_the_timeout(then, role, tmp_path):
    async def scenario():
        async with swarm(2, honest_first(role, tmp_path)) as nodes:
            async with averagers(nodes[:1]) as (honest,), averagers(nodes[1:], cls=FaultyAverager, fault=Fault.STALL) as (faulty,):
                assert (honest.peer_id < faulty.peer_id) == (role == "honest_calls")
                theta = weights(1)
                before = snapshot(theta)
                timeout = 3.0

                async def kill_when_stalled():
                    await faulty.stalled.wait()
                    if then == "dies":
                        await faulty.stop(timeout=2)
                        await shutdown_dht(nodes[1], timeout=5)

                killer = asyncio.create_task(kill_when_stalled())
                started = time.monotonic()
                result, _ = await asyncio.gather(honest.average(theta, 3, timeout=timeout), faulty.average(weights(2), 3, timeout=timeout))
                elapsed = time.monotonic() - started
                await asyncio.wait_for(killer, 10)
                assert faulty.stalled.is_set()  # the exchange really started
                assert result is None
                assert elapsed < timeout + 1.0
                assert_untouched(theta, before)
                assert honest.rounds_skipped == 1 and honest.failures["no_partner"] == 1

    asyncio.run(scenario())


@pytest.mark.parametrize("role", ROLES)
def test_hostile_partners_are_refused_and_counted(role, tmp_path):
    async def scenario():
        async with swarm(2, honest_first(role, tmp_path)) as nodes:
            cases = [(Fault.NAN, "not_finite"), (Fault.WRONG_SHAPE, "wrong_shape"), (Fault.FAR_AWAY, "too_far"), (Fault.OVERSIZED, "malformed")]
            for round_id, (fault, reason) in enumerate(cases):
                async with averagers(nodes[:1]) as (honest,), averagers(nodes[1:], cls=FaultyAverager, fault=fault) as (hostile,):
                    theta = weights(1)
                    before = snapshot(theta)
                    started = time.monotonic()

                    async def timed_honest():
                        result = await honest.average(theta, round_id, timeout=6)
                        return result, time.monotonic() - started

                    (result, elapsed), _ = await asyncio.gather(timed_honest(), hostile.average(weights(2), round_id, timeout=6))
                    assert result is None, fault
                    assert honest.refusals == {reason: 1}, (fault, honest.refusals, honest.failures)
                    assert elapsed < 3.0  # the refused partner is given up: no waiting for the timeout
                    assert_untouched(theta, before)

    asyncio.run(scenario())


@pytest.mark.parametrize("role", ROLES)
def test_a_lost_done_frame_is_counted_as_an_unconfirmed_outcome(role, tmp_path):
    async def scenario():
        async with swarm(2, honest_first(role, tmp_path)) as nodes:
            async with averagers(nodes[:1]) as (honest,), averagers(nodes[1:], cls=FaultyAverager, fault=Fault.NO_DONE) as (broken,):
                result, _ = await asyncio.gather(honest.average(weights(1), 5, timeout=6), broken.average(weights(2), 5, timeout=6))
                assert result is not None  # it averaged, and cannot know whether its partner did: counted, not silent
                assert honest.failures["outcome_unconfirmed"] == 1
                assert broken.failures["outcome_unconfirmed"] == 0  # the honest side's DONE did arrive

    asyncio.run(scenario())

