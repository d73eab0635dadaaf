"""The LM driver's record of a lost stage coming back (node/pipeline/lm.py), in process: the servers' signed stage
announcements live in a real DHT node, and their calls are answered by a router subclass (no stage server runs;
a server that is down times out)."""

from __future__ import annotations

import asyncio
import contextlib
import math

import pytest
import torch

from node.aio import StopRequested
from node.config import load_config
from node.pipeline.client import HopFailed, until_answered
from node.pipeline.driver import PipelineRouter, route_hops
from node.pipeline.lm import LMDriver
from node.pipeline.stagemap import Announcer, LostReporter, read_stage_map
from node.pipeline.tensors import from_wire, to_wire
from node.state import StateStore
from node.transport.joining import shutdown_dht
from node.transport.session import SwarmSession
from protocol import NodeIdentity, StageAnnouncement
from protocol.pipeline import DEFAULT_PIPELINE_LIMITS, PIPELINE_VERSION, StageResult
from tests.helpers.averaging import swarm
from tests.helpers.swarm import wait_for_async

VOCAB, HIDDEN = 16, 4
FINGERPRINTS = ["fp0", "fp1"]


def serving(stage: int, node_id: str, p2p_peer_id: str, step: int, grad_norm: float) -> StageAnnouncement:
    """A server of one layer of the tests' two-stage model, serving `stage`."""
    return StageAnnouncement(
        node_id=node_id,
        p2p_peer_id=p2p_peer_id,
        model_fingerprint="m",
        num_stages=2,
        stage=stage,
        stage_fingerprint=FINGERPRINTS[stage],
        layer_start=stage,
        layer_end=stage + 1,
        parts=["layers"],
        state="serving",
        step=step,
        grad_norm=grad_norm,
        samples_per_s=1.0,
        recoveries=0,
        replicas=[],
    )


def config(tmp_path):
    return load_config(
        None,
        [
            "swarm.swarm_id=test-driver",
            "pipeline.num_stages=2",
            "pipeline.micro_batches=1",
            "pipeline.micro_batch_size=2",
            "pipeline.eval_every=0",
            "pipeline.announce_interval_s=0.2",
            "pipeline.announce_ttl_s=1.0",
        ],
        state_dir=str(tmp_path / "driver"),
    )


class ScriptedRouter(PipelineRouter):
    """Answers every stage call as a server of zero weights would; calls to servers in `down` time out."""

    down: set[str]

    async def call(self, server, call, timeout=None):
        if server.node_id in self.down:
            raise HopFailed(server, "timeout", "scripted: it never answers")
        tensors = {}
        if call.op == "forward":
            given = from_wire(call.tensors["input_ids"] if "input_ids" in call.tensors else call.tensors["hidden"])
            width = VOCAB if "head" in call.parts else HIDDEN
            tensors = {"output": to_wire(torch.zeros(*given.shape[:2], width))}
        elif call.op == "backward":
            grad = from_wire(call.tensors["grad"])
            tensors = {"grad": to_wire(torch.zeros(*grad.shape[:2], HIDDEN))}
        return StageResult(v=PIPELINE_VERSION, tensors=tensors, weights=None, step=1, grad_norm=0.5, lr_scale=1.0)


class Server:
    """A stage server's identity and its signed announcements (only the announcing: its calls are the router's)."""

    def __init__(self, cfg, dht, stage: int) -> None:
        self.session = SwarmSession(cfg, dht, "direct", NodeIdentity.generate())
        self.node_id = self.session.identity.node_id
        self.stage = stage

    async def announce(self) -> None:
        await Announcer(self.session).publish(
            serving(self.stage, self.node_id, self.node_id[:16], step=1, grad_norm=0.5)
        )


class Stand:
    """A driver of the two-stage model and the servers announcing to it every announce interval (`up`); servers in
    `router.down` time out."""

    def __init__(self, cfg, node, router: ScriptedRouter, driver: LMDriver) -> None:
        self.cfg, self.node, self.router, self.driver = cfg, node, router, driver
        self.up: set[Server] = set()

    async def announcing(self) -> None:
        while True:
            await asyncio.gather(*(server.announce() for server in list(self.up)))
            await asyncio.sleep(self.cfg.pipeline.announce_interval_s)

    async def silent_until_aged_out(self, server: Server) -> None:
        self.up.discard(server)
        self.router.down.add(server.node_id)
        for _ in range(200):
            if not (await read_stage_map(self.node, self.cfg, "m")).servers.get(server.stage):
                return
            await asyncio.sleep(0.1)
        raise AssertionError("the silent server's announcement never aged out")

    async def lost(self, stage: int, step: asyncio.Task) -> None:
        """Until the driver has found `stage` lost in the step it runs."""
        for _ in range(200):
            if stage in self.driver.lost_since or step.done():
                break
            await asyncio.sleep(0.1)
        assert stage in self.driver.lost_since, f"the driver never found stage {stage} lost"

    def back(self, server: Server) -> None:
        self.router.down.discard(server.node_id)
        self.up.add(server)

    async def trains_with(self, *servers: Server) -> None:
        """The servers announce, and a first step goes through them without any recovery to record."""
        for server in servers:
            self.back(server)
            await server.announce()
        assert "recovery" not in await self.driver.train_step()


@contextlib.asynccontextmanager
async def stand(cfg):
    async with swarm(1) as (node,):
        driver_session = SwarmSession(cfg, node, "direct", NodeIdentity.generate())
        router = ScriptedRouter(
            node, cfg, "m", FINGERPRINTS, DEFAULT_PIPELINE_LIMITS, reporter=LostReporter(driver_session, "m")
        )
        router.down = set()
        corpus = torch.randint(0, VOCAB, (16, 8), generator=torch.Generator().manual_seed(0))
        it = Stand(cfg, node, router, LMDriver(cfg, router, corpus, corpus, StateStore(cfg.resolved_state_dir())))
        beat = asyncio.create_task(it.announcing())
        try:
            yield it
        finally:
            beat.cancel()
            await asyncio.gather(beat, return_exceptions=True)


@pytest.mark.integration
def test_the_recovery_record_says_replaced_only_when_another_server_took_the_stage(tmp_path):
    """Stage 1's server goes silent until its announcement has aged out of every map, so the driver finds the stage
    lost with nobody in its map; the same server coming back is not a replacement, a new one is."""
    cfg = config(tmp_path)

    async def scenario():
        async with stand(cfg) as it:
            first, second, other = (Server(cfg, it.node, stage) for stage in (0, 1, 1))

            async def lost_then_served_by(server: Server) -> dict:
                """A step that finds stage 1 lost, and is done once `server` announces it; its recovery record."""
                step = asyncio.create_task(it.driver.train_step())
                await it.lost(1, step)
                it.back(server)
                row = await asyncio.wait_for(step, 60)
                [event] = row["recovery"]
                assert event["stage"] == 1 and event["servers"] == [server.node_id], event
                return event

            await it.trains_with(first, second)

            await it.silent_until_aged_out(second)
            assert not (await lost_then_served_by(second))["replaced"]  # the same server answered again

            await it.silent_until_aged_out(second)
            assert (await lost_then_served_by(other))["replaced"]  # another server took the stage

    asyncio.run(scenario())


@pytest.mark.integration
def test_a_stage_that_dies_while_the_driver_waits_for_another_is_recorded_when_it_comes_back(tmp_path):
    """Stage 1 is lost; while the driver waits for it, stage 0's server goes silent too (two neighbours killed a
    moment apart). The step after both are served again records both stages, stage 0's as found while waiting."""
    cfg = config(tmp_path)

    async def scenario():
        async with stand(cfg) as it:
            first, second, new_first, new_second = (Server(cfg, it.node, stage) for stage in (0, 1, 0, 1))
            await it.trains_with(first, second)

            await it.silent_until_aged_out(second)
            step = asyncio.create_task(it.driver.train_step())
            await it.lost(1, step)
            assert 0 not in it.driver.lost_since
            await it.silent_until_aged_out(first)
            await it.lost(0, step)
            it.back(new_first)
            it.back(new_second)
            row = await asyncio.wait_for(step, 60)
            events = {event["stage"]: event for event in row["recovery"]}
            assert sorted(events) == [0, 1], row["recovery"]
            assert events[0]["cause"] == "no live server" and events[0]["replaced"]
            assert events[0]["servers"] == [new_first.node_id]
            assert events[1]["servers"] == [new_second.node_id] and events[1]["replaced"]

    asyncio.run(scenario())


class FixedRouter(ScriptedRouter):
    """One fixed server per stage (no DHT); notes which micro-batches are between their first forward and their last
    backward at every call, and yields to the event loop inside each call as a network call would."""

    def __init__(self, cfg) -> None:
        super().__init__(None, cfg, "m", FINGERPRINTS, DEFAULT_PIPELINE_LIMITS)
        self.down = set()
        self.servers = {stage: serving(stage, f"n{stage}", "p", step=0, grad_norm=0.0) for stage in (0, 1)}
        self.open: set[str] = set()
        self.most_open = 0

    async def pick_route(self, hops):
        return {stage: self.servers[stage] for stage, _ in hops}

    async def call(self, server, call, timeout=None):
        micro_batch = call.call_id.split("-")[1]  # "s{step}-m{index}-a{attempt}-{ns}-{hop}"
        if call.op == "forward" and call.parts[0] == "embed":
            self.open.add(micro_batch)
        self.most_open = max(self.most_open, len(self.open))
        for _ in range(3):
            await asyncio.sleep(0)
        if call.op == "backward" and call.parts[0] == "embed":
            self.open.discard(micro_batch)
        return await super().call(server, call, timeout)


def test_micro_batches_in_flight_bounds_how_many_travel_at_once_and_keeps_the_losses(tmp_path):
    """4 micro-batches: one at a time, two at a time, all four; servers of zero weights give uniform logits over the
    16 tokens, so every micro-batch's loss is ln 16 = 2.7726, in whatever order they finish."""

    async def most_open(in_flight: int) -> tuple[int, dict]:
        cfg = config(tmp_path / str(in_flight)).model_copy(deep=True)
        cfg.pipeline.micro_batches = 4
        cfg.pipeline.micro_batches_in_flight = in_flight
        cfg.pipeline.checkfree_plus = False
        router = FixedRouter(cfg)
        corpus = torch.randint(0, VOCAB, (16, 8), generator=torch.Generator().manual_seed(0))
        driver = LMDriver(cfg, router, corpus, corpus, StateStore(cfg.resolved_state_dir()))
        row = await driver.train_step()
        return router.most_open, row

    for in_flight, expected in ((1, 1), (2, 2), (4, 4), (8, 4)):
        seen, row = asyncio.run(most_open(in_flight))
        assert seen == expected, (in_flight, seen)
        assert abs(row["loss"] - 2.7726) < 1e-4 and row["retries"] == 0
        assert set(row["grad_norms"]) == {0, 1}


def test_checkfree_plus_swaps_one_micro_batch_in_swap_every_counted_over_the_run(tmp_path):
    """3 micro-batches a step for 4 steps: with pipeline.checkfree_plus_swap_every=4 the 4th, 8th and 12th run in
    swapped order (stage 1's layers before stage 0's: the embedding is a call of its own), whichever step they are
    in; with the default 2, every second one."""

    async def swapped(every: int) -> list[bool]:
        cfg = config(tmp_path / f"every{every}").model_copy(deep=True)
        cfg.pipeline.micro_batches = 3
        cfg.pipeline.checkfree_plus_swap_every = every
        router = FixedRouter(cfg)
        calls: list[tuple[list[str], list[str]]] = []  # (['s<step>', 'm<index>'], the call's parts)
        answer = router.call

        async def noting(server, call, timeout=None):
            if call.op == "forward":
                calls.append((call.call_id.split("-")[:2], list(call.parts)))
            return await answer(server, call, timeout)

        router.call = noting
        corpus = torch.randint(0, VOCAB, (16, 8), generator=torch.Generator().manual_seed(0))
        driver = LMDriver(cfg, router, corpus, corpus, StateStore(cfg.resolved_state_dir()))
        for _ in range(4):
            await driver.train_step()
        micro_batches = sorted({tuple(int(x[1:]) for x in key) for key, _ in calls})
        alone = {tuple(int(x[1:]) for x in key) for key, parts in calls if parts == ["embed"]}
        return [mb in alone for mb in micro_batches]

    assert asyncio.run(swapped(4)) == [False, False, False, True] * 3
    assert asyncio.run(swapped(2)) == [False, True] * 6


async def one_step(tmp_path, router_type, breaks: int, reason: str):
    """One driver step of the two-stage model (no CheckFree+ swaps) through `router_type(cfg, breaks, reason)`; the
    router and the step's row."""
    cfg = config(tmp_path / f"{reason}{breaks}").model_copy(deep=True)
    cfg.pipeline.checkfree_plus = False
    router = router_type(cfg, breaks, reason)
    corpus = torch.randint(0, VOCAB, (16, 8), generator=torch.Generator().manual_seed(0))
    row = await LMDriver(cfg, router, corpus, corpus, StateStore(cfg.resolved_state_dir())).train_step()
    return router, row


class BrokenStepRouter(FixedRouter):
    """FixedRouter whose step calls to stage 1 fail `breaks` times first, with `reason`; it notes every step call."""

    def __init__(self, cfg, breaks: int, reason: str) -> None:
        super().__init__(cfg)
        self.breaks, self.reason = breaks, reason
        self.step_calls: list[tuple[int, str]] = []

    async def call(self, server, call, timeout=None):
        if call.op == "step":
            self.step_calls.append((server.stage, call.call_id))
            if server.stage == 1 and self.breaks:
                self.breaks -= 1
                raise HopFailed(server, self.reason, "scripted")
        return await super().call(server, call, timeout)


def test_a_step_call_whose_stream_broke_is_sent_again_and_a_dead_server_is_not_waited_for_twice(tmp_path):
    """A reset stream (reason 'unreachable') may have lost the server's answer or the call itself: the driver sends
    the same call again, up to 3 tries (the server answers a repeat without applying it twice: test_pipeline_backend).
    A timeout is not retried (the server is presumed dead, and another try would cost another call_timeout_s)."""

    def run_step(breaks: int, reason: str) -> tuple[BrokenStepRouter, dict]:
        return asyncio.run(one_step(tmp_path, BrokenStepRouter, breaks, reason))

    router, row = run_step(2, "unreachable")
    stage_one = [call_id for stage, call_id in router.step_calls if stage == 1]
    assert len(stage_one) == 3 and len(set(stage_one)) == 1  # the same call, three times
    assert set(row["grad_norms"]) == {0, 1} and "n1" not in router.avoid
    router, row = run_step(3, "unreachable")  # three broken streams: the stage's step failed
    assert len([1 for stage, _ in router.step_calls if stage == 1]) == 3 and set(row["grad_norms"]) == {0}
    router, row = run_step(1, "timeout")
    assert len([1 for stage, _ in router.step_calls if stage == 1]) == 1 and set(row["grad_norms"]) == {0}
    assert "n1" in router.avoid


def test_a_step_call_a_server_never_answered_is_sent_again_before_the_next_step_adds_gradients(tmp_path):
    """Stage 1 answers none of step 1's three tries (its answer lost, or the call): the step counts without it, and
    the next step first sends stage 1 the same call again, before its first forward (a server that applied it
    answers from memory, one that never received it applies it now: it must not keep step 1's gradients for step
    2). One that answers that neither is owed nothing more."""

    async def two_steps(breaks: int):
        cfg = config(tmp_path / f"owed{breaks}").model_copy(deep=True)
        cfg.pipeline.checkfree_plus = False
        router = BrokenStepRouter(cfg, breaks, "unreachable")
        corpus = torch.randint(0, VOCAB, (16, 8), generator=torch.Generator().manual_seed(0))
        driver = LMDriver(cfg, router, corpus, corpus, StateStore(cfg.resolved_state_dir()))
        first = await driver.train_step()
        steps_before = len(router.step_calls)
        second = await driver.train_step()
        return router.step_calls[:steps_before], router.step_calls[steps_before:], first, second

    first_calls, second_calls, first, second = asyncio.run(two_steps(3))
    assert set(first["grad_norms"]) == {0}  # stage 1 did not answer step 1
    step_one = {call_id for stage, call_id in first_calls if stage == 1}
    assert len(step_one) == 1
    assert second_calls[0] == (1, step_one.pop())  # the same call, first of step 2's
    assert [stage for stage, _ in second_calls[1:]] in ([0, 1], [1, 0]) and second["step"] == 2
    assert set(second["grad_norms"]) == {0, 1}

    first_calls, second_calls, _, second = asyncio.run(two_steps(6))  # it answers step 1's call neither time
    step_one = {call_id for stage, call_id in first_calls if stage == 1}
    assert second_calls[:3] == [(1, *step_one)] * 3  # sent again (three broken streams), then owed nothing more
    assert sorted(stage for stage, _ in second_calls[3:]) == [0, 1] and set(second["grad_norms"]) == {0, 1}


class HungStepRouter(FixedRouter):
    """FixedRouter that notes every call as (op, stage, call id, scale); the first step call to stage 1 never answers,
    as over a connection that died, until the step is cancelled."""

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.calls: list[tuple[str, int, str, float]] = []
        self.hung = False

    async def call(self, server, call, timeout=None):
        self.calls.append((call.op, server.stage, call.call_id, call.scale))
        if call.op == "step" and server.stage == 1 and not self.hung:
            self.hung = True
            await asyncio.Event().wait()
        return await super().call(server, call, timeout)


def test_a_step_cancelled_in_its_step_call_is_finished_with_the_same_call_and_not_taken_again(tmp_path):
    """`drive` cancels the step in flight when its connection dies. Once its micro-batches went through, taking it
    again would have a server that applied its step call apply the step a second time: the step call is sent again
    instead, the same call to the same servers (answered from memory where it was applied), and the step counts once,
    with the losses of its micro-batches."""

    async def scenario():
        cfg = config(tmp_path).model_copy(deep=True)
        cfg.pipeline.checkfree_plus = False
        router = HungStepRouter(cfg)
        corpus = torch.randint(0, VOCAB, (16, 8), generator=torch.Generator().manual_seed(0))
        driver = LMDriver(cfg, router, corpus, corpus, StateStore(cfg.resolved_state_dir()))
        first = asyncio.create_task(driver.train_step())
        await wait_for_async(lambda: router.hung, 20, "the step call to stage 1 to hang")
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        assert driver.step == 0
        tried = len(router.calls)
        row = await driver.train_step()
        finished = router.calls[tried:]
        after = len(router.calls)
        next_row = await driver.train_step()
        return router.calls[:tried], finished, row, router.calls[after:], next_row

    tried, finished, row, next_calls, next_row = asyncio.run(scenario())
    cut_short = {(stage, call_id) for op, stage, call_id, _ in tried if op == "step"}
    assert {stage for stage, _ in cut_short} == {0, 1} and len({call_id for _, call_id in cut_short}) == 1
    assert sorted((op, stage, call_id) for op, stage, call_id, _ in finished) == sorted(
        ("step", stage, call_id) for stage, call_id in cut_short
    )  # no forward, no drop: the same step call, again
    assert all(scale == 1.0 for *_, scale in finished)
    assert row["step"] == 1 and row["grad_norms"] == {0: 0.5, 1: 0.5} and math.isfinite(row["loss"])
    assert next_row["step"] == 2 and [op for op, *_ in next_calls][:2] == ["forward", "forward"]


class LostAnswerRouter(FixedRouter):
    """FixedRouter whose forward and backward calls to stage 1 lose their answer (the call ran: the server's work is
    done) `breaks` times each, with `reason`; it notes every call as (op, stage, call id)."""

    def __init__(self, cfg, breaks: int, reason: str) -> None:
        super().__init__(cfg)
        self.breaks = {"forward": breaks, "backward": breaks}
        self.reason = reason
        self.calls: list[tuple[str, int, str]] = []

    async def call(self, server, call, timeout=None):
        self.calls.append((call.op, server.stage, call.call_id))
        result = await super().call(server, call, timeout)
        if server.stage == 1 and self.breaks.get(call.op):
            self.breaks[call.op] -= 1
            raise HopFailed(server, self.reason, "scripted: the stream ended inside the answer")
        return result


def test_a_forward_or_backward_whose_stream_broke_is_sent_again_to_the_same_server(tmp_path):
    """Under load a stream may end inside a live server's answer: the driver sends the same call to the same server
    again (up to 3 tries) instead of routing the micro-batch anew (every earlier hop again) or, for a backward, leaving
    the earlier stages without that micro-batch's gradient (the server answers a repeated backward from memory:
    test_pipeline_backend). The repeats are counted apart from failures; a timeout is not repeated."""

    def run_step(breaks: int, reason: str) -> tuple[LostAnswerRouter, dict]:
        return asyncio.run(one_step(tmp_path, LostAnswerRouter, breaks, reason))

    router, row = run_step(2, "unreachable")
    for op in ("forward", "backward"):
        to_stage_one = [call_id for called, stage, call_id in router.calls if called == op and stage == 1]
        assert len(to_stage_one) == 3 and len(set(to_stage_one)) == 1  # the same call, three times
    # stage 0 ran its forward once and got its backward: one route, nothing lost, nothing avoided
    assert [op for op, stage, _ in router.calls if stage == 0] == ["forward", "backward", "step"]
    assert row["retries"] == 0 and row["backward_failures"] == 0 and row["hop_failures"] == {}
    assert row["repeated_calls"] == {"forward": 2, "backward": 2} and not router.avoid
    router, row = run_step(1, "timeout")  # a timeout: another route, not the same call again
    assert row["retries"] == 1 and row["repeated_calls"] == {}
    assert len({call_id for op, stage, call_id in router.calls if op == "forward" and stage == 1}) == 2


def test_until_answered_repeats_only_a_broken_stream_and_at_most_three_times():
    """The repeat every idempotent call uses (forward, backward, step, and a new server's `weights` reads): a broken
    stream ('unreachable') is sent again, up to 3 tries in all; a timeout or a refusal ends it at once."""
    server = serving(1, "n1", "p", step=0, grad_norm=0.0)
    answer = StageResult(v=PIPELINE_VERSION, tensors={}, weights=None, step=1, grad_norm=0.0, lr_scale=1.0)

    def scripted(*reasons: str):
        tries: list[str] = []
        remaining = list(reasons)

        async def send():
            tries.append("try")
            if remaining:
                raise HopFailed(server, remaining.pop(0), "scripted")
            return answer

        return send, tries

    async def outcome(*reasons: str):
        send, tries = scripted(*reasons)
        repeats: list[str] = []
        try:
            result = await until_answered(send, lambda failure: repeats.append(failure.reason))
        except HopFailed as failure:
            result = failure.reason
        return result, len(tries), repeats

    assert asyncio.run(outcome()) == (answer, 1, [])
    assert asyncio.run(outcome("unreachable", "unreachable")) == (answer, 3, ["unreachable", "unreachable"])
    assert asyncio.run(outcome("unreachable", "unreachable", "unreachable")) == ("unreachable", 3, ["unreachable"] * 2)
    assert asyncio.run(outcome("timeout")) == ("timeout", 1, [])
    assert asyncio.run(outcome("unreachable", "refused:busy")) == ("refused:busy", 2, ["unreachable"])


class CancelledTryRouter(FixedRouter):
    """FixedRouter that notes every call as (op, stage, call id, scale); the first backward to stage 0 (stage 1 has
    accumulated that micro-batch's gradients by then) never answers, as over a connection that died, until the step
    is cancelled."""

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.calls: list[tuple[str, int, str, float]] = []
        self.hung = False

    async def call(self, server, call, timeout=None):
        self.calls.append((call.op, server.stage, call.call_id, call.scale))
        if call.op == "backward" and server.stage == 0 and not self.hung:
            self.hung = True
            await asyncio.Event().wait()
        return await super().call(server, call, timeout)


def test_a_step_taken_again_after_its_try_was_cancelled_first_drops_what_that_try_left_on_the_servers(tmp_path):
    """`drive` cancels the step in flight when its connection dies and takes it again once rejoined: the servers the
    cancelled try touched get a drop (a step of scale 0) before the retake's first forward, so that the gradients it
    left do not add to the retake's."""

    async def scenario():
        cfg = config(tmp_path).model_copy(deep=True)
        cfg.pipeline.checkfree_plus = False
        router = CancelledTryRouter(cfg)
        corpus = torch.randint(0, VOCAB, (16, 8), generator=torch.Generator().manual_seed(0))
        driver = LMDriver(cfg, router, corpus, corpus, StateStore(cfg.resolved_state_dir()))
        first = asyncio.create_task(driver.train_step())
        await wait_for_async(lambda: router.hung, 20, "the first try to hang in its backward")
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        tried = len(router.calls)
        row = await driver.train_step()
        return router.calls[:tried], router.calls[tried:], row

    tried, retake, row = asyncio.run(scenario())
    assert [op for op, *_ in tried] == ["forward", "forward", "backward", "backward"]  # stage 1 holds a gradient
    first_forward = next(k for k, (op, *_) in enumerate(retake) if op == "forward")
    drops = [(stage, scale) for op, stage, _, scale in retake[:first_forward] if op == "step"]
    assert sorted(drops) == [(0, 0.0), (1, 0.0)]
    steps = [(stage, call_id, scale) for op, stage, call_id, scale in retake[first_forward:] if op == "step"]
    assert sorted((stage, scale) for stage, _, scale in steps) == [(0, 1.0), (1, 1.0)]
    dropped_as = {call_id for op, _, call_id, _ in retake[:first_forward] if op == "step"}
    assert dropped_as.isdisjoint(call_id for _, call_id, _ in steps)  # the retake's step is a call of its own
    assert row["step"] == 1 and row["grad_norms"] == {0: 0.5, 1: 0.5}


class StepCallsRouter(FixedRouter):
    """FixedRouter whose first `breaks` step calls to stage 1 time out; it notes every step call as (stage, call id,
    scale)."""

    def __init__(self, cfg, breaks: int) -> None:
        super().__init__(cfg)
        self.breaks = breaks
        self.step_calls: list[tuple[int, str, float]] = []

    async def call(self, server, call, timeout=None):
        if call.op == "step":
            self.step_calls.append((server.stage, call.call_id, call.scale))
            if server.stage == 1 and self.breaks:
                self.breaks -= 1
                raise HopFailed(server, "timeout", "scripted: no answer")
        return await super().call(server, call, timeout)


def grpo_rounds(tmp_path, breaks: int, rounds: int) -> tuple[StepCallsRouter, list[tuple[list, object, int]]]:
    """`rounds` GRPO updates of a policy split over the two stages (node/pipeline/remote_model.py), through a router
    whose first `breaks` step calls to stage 1 time out: the router, and each round's step calls, stats and policy
    version."""
    from node.pipeline.remote_model import RemoteCausalLM, RemoteOptimizer
    from node.rollouts.base import Completion, RolloutGroup, TrainingBatch
    from node.trainer import GRPOTrainer
    from protocol.specs import TaskSpec

    cfg = config(tmp_path).model_copy(deep=True)
    cfg.pipeline.checkfree_plus = False
    uniform = -math.log(VOCAB)  # the log-prob of every token under the zero logits the scripted servers give
    completions = [
        Completion(
            prompt_ids=[3, 4],
            completion_ids=ids,
            text="",
            logprobs=[uniform] * 2,
            finish_reason="stop",
            policy_version=0,
        )
        for ids in ([5, 6], [7, 8])
    ]
    batch = TrainingBatch([RolloutGroup(TaskSpec("x", {}, 0, 0), completions, rewards=[1.0, 0.0])])

    async def scenario():
        router = StepCallsRouter(cfg, breaks)
        model = RemoteCausalLM(None, cfg.pipeline)
        model.attach(router, asyncio.get_running_loop())
        trainer = GRPOTrainer(cfg.trainer, model, 0, 1.0, optimizer=RemoteOptimizer(model))
        seen = []
        for _ in range(rounds):
            before = len(router.step_calls)
            for completion in completions:  # on-policy each round: the scripted servers' logits never move
                completion.policy_version = trainer.policy_version
            stats = await asyncio.to_thread(trainer.step, batch)
            seen.append((router.step_calls[before:], stats, trainer.policy_version))
        return router, seen

    return asyncio.run(scenario())


def test_a_grpo_update_that_a_stage_did_not_apply_is_no_policy_version_and_its_gradients_are_dropped(tmp_path):
    """The stage-1 server does not answer the step: the round reports no step and keeps the policy version, and that
    server is sent a drop (scale 0) under a call id of its own, so that what it may still hold does not add to the next
    update; the next round steps both stages and counts."""
    _, seen = grpo_rounds(tmp_path / "once", breaks=1, rounds=2)
    (calls, stats, version), (again, next_stats, next_version) = seen
    assert not stats.stepped and version == 0
    step_id = next(call_id for stage, call_id, scale in calls if stage == 0)
    assert sorted((stage, call_id) for stage, call_id, scale in calls if scale == 1.0) == [(0, step_id), (1, step_id)]
    drops = [(stage, call_id) for stage, call_id, scale in calls if scale == 0.0]
    assert [stage for stage, _ in drops] == [1] and drops[0][1] != step_id  # a call of its own: not the step's repeat
    assert next_stats.stepped and next_version == 1
    assert sorted((stage, scale) for stage, _, scale in again) == [(0, 1.0), (1, 1.0)]  # nothing left to drop


def test_a_drop_that_finds_no_answer_is_tried_once_more_before_the_next_update_then_nothing_is_owed(tmp_path):
    """A server that answers neither the step nor its drop (our connection down, or the server): the drop is sent
    again before the next round's update adds gradients there; one that answers that neither is owed nothing more."""
    _, seen = grpo_rounds(tmp_path / "twice", breaks=2, rounds=2)
    (_, stats, version), (again, next_stats, next_version) = seen
    assert not stats.stepped and version == 0
    first_apply = next(k for k, (_, _, scale) in enumerate(again) if scale == 1.0)
    assert [(stage, scale) for stage, _, scale in again[:first_apply]] == [(1, 0.0)]  # before any new gradient
    assert next_stats.stepped and next_version == 1

    _, seen = grpo_rounds(tmp_path / "never", breaks=3, rounds=3)
    (_, first, _), (second_calls, second, _), (third_calls, third, version) = seen
    assert not first.stepped and [scale for stage, _, scale in second_calls if stage == 1] == [0.0, 1.0]
    assert second.stepped and third.stepped and version == 2
    assert all(scale == 1.0 for _, _, scale in third_calls)  # nothing owed to a server that answered no drop


class CountingRouter(PipelineRouter):
    """A router that counts its stage-map reads."""

    reads = 0

    async def refresh(self, force: bool = False):
        self.reads += 1
        return await super().refresh(force)


@pytest.mark.integration
def test_a_router_whose_dht_was_shut_down_waits_and_routes_over_the_new_one_once_rebound(tmp_path):
    """A join node's pipeline policy loses its session mid-round: its router's DHT is shut down while the round waits
    for the stages. The wait goes on (nothing raises out of it), ends once the router is rebound to the new session's
    DHT, and routes to the servers that failed over the dead connection (the failures were the connection's); a stop
    ends such a wait."""
    cfg = config(tmp_path).model_copy(deep=True)
    cfg.pipeline.avoid_s = 3600.0  # far past the test: a failure seen over the dead connection must not be waited out
    hops = route_hops(2, [0, 1])

    async def scenario():
        async with swarm(1) as (old,), swarm(1) as (new,):
            stop = asyncio.Event()
            router = CountingRouter(old, cfg, "m", FINGERPRINTS, DEFAULT_PIPELINE_LIMITS, stop=stop)
            servers = [Server(cfg, old, stage) for stage in (0, 1)]
            await asyncio.gather(*(server.announce() for server in servers))
            await asyncio.wait_for(router.wait_until_served(), 60)
            for server in (await router.pick_route(hops)).values():  # its calls fail: our daemon is dead
                router.fail(HopFailed(server, "timeout", "scripted: over a dead daemon"))
            await shutdown_dht(old)
            waiting = asyncio.create_task(router.wait_until_served())
            reads = router.reads
            await wait_for_async(lambda: waiting.done() or router.reads >= reads + 3, 30, "reads of the dead DHT")
            assert not waiting.done()  # still waiting: it raised nothing
            for server in servers:  # the same servers, as the new session reads them
                server.session = SwarmSession(cfg, new, "direct", server.session.identity)
                await server.announce()
            router.rebind(new, None)
            await asyncio.wait_for(waiting, 60)
            route = await router.pick_route(hops)
            assert {s.node_id for s in route.values()} == {server.node_id for server in servers}

            router.rebind(old, None)  # a wait over a dead DHT again, and the node is asked to stop
            waiting = asyncio.create_task(router.wait_until_served())
            stop.set()
            with pytest.raises(StopRequested):
                await asyncio.wait_for(waiting, 60)

    asyncio.run(scenario())
