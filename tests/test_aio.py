"""Shutdown ends background loops even when a cancellation is swallowed."""

import asyncio
import functools
import logging

import pytest

from node.aio import ServiceDied, cancel_and_wait, gather_or_cancel, retry_with_backoff, run_supervised


def test_a_loop_that_swallows_a_cancellation_still_ends():
    async def scenario():
        swallowed = []
        looping = asyncio.Event()

        async def stubborn_loop():  # swallows its first cancellation, as 3.11's wait_for can
            while True:
                try:
                    looping.set()
                    await asyncio.sleep(0.01)
                except asyncio.CancelledError:
                    if swallowed:
                        raise
                    swallowed.append(True)

        task = asyncio.create_task(stubborn_loop())
        await asyncio.wait_for(looping.wait(), 60)  # a task cancelled before it ran swallows nothing
        await cancel_and_wait([task], "test")
        assert swallowed and task.cancelled()

    asyncio.run(scenario())


def test_a_loop_around_wait_for_ends_when_its_result_and_the_cancel_arrive_together():
    async def scenario():
        futures: list[asyncio.Future] = []
        turns = []

        async def heartbeat_like_loop():
            while True:
                answer = asyncio.get_running_loop().create_future()
                futures.append(answer)
                await asyncio.wait_for(answer, 30)
                turns.append(len(futures))

        task = asyncio.create_task(heartbeat_like_loop())
        await asyncio.sleep(0)
        futures[-1].set_result(None)  # the answer lands in the loop iteration of the first cancellation
        await cancel_and_wait([task], "test", grace_s=10)
        assert task.done()

    asyncio.run(scenario())


def test_a_task_that_never_ends_is_left_with_a_warning(caplog):
    async def scenario():
        released = asyncio.Event()

        async def immortal():  # ignores cancellation until released (asyncio.run would wait for it for ever)
            while not released.is_set():
                try:
                    await asyncio.sleep(0.01)
                except asyncio.CancelledError:
                    continue

        task = asyncio.create_task(immortal())
        await asyncio.sleep(0)
        with caplog.at_level(logging.WARNING, logger="node.aio"):
            await cancel_and_wait([task], "immortal test task", grace_s=0.3)
        assert not task.done()
        assert "immortal test task: 1 task(s) still running" in caplog.text
        released.set()
        await task

    asyncio.run(scenario())


async def work_that_records_its_cancellation(cancelled: list, started: asyncio.Event | None = None) -> None:
    try:
        if started is not None:
            started.set()
        await asyncio.sleep(60)
    except asyncio.CancelledError:
        cancelled.append(True)
        raise


def test_a_service_that_dies_stops_the_work_beside_it_loudly():
    async def scenario():
        cancelled = []
        work = functools.partial(work_that_records_its_cancellation, cancelled)

        async def service():
            await asyncio.sleep(0.05)
            raise ValueError("a bug in the service")

        task = asyncio.create_task(service(), name="membership")
        try:
            await run_supervised(work(), [task], "stage server")
        except ServiceDied as failure:  # the part to restart, told from a failure of the work itself
            assert "membership" in str(failure) and isinstance(failure.__cause__, ValueError)
        else:
            raise AssertionError("the dead service went unnoticed")
        assert cancelled

    asyncio.run(scenario())


def test_supervised_work_returns_its_result_and_is_cancelled_with_its_caller():
    async def scenario():
        async def service():
            await asyncio.sleep(60)

        task = asyncio.create_task(service())
        assert await run_supervised(asyncio.sleep(0.01, result=7), [task], "driver") == 7
        assert not task.done()  # the services are the caller's to stop

        cancelled = []
        started = asyncio.Event()
        work = functools.partial(work_that_records_its_cancellation, cancelled, started)

        caller = asyncio.create_task(run_supervised(work(), [task], "driver"))
        await asyncio.wait_for(started.wait(), 60)  # work cancelled before it ran would record nothing
        caller.cancel()
        try:
            await caller
        except asyncio.CancelledError:
            pass
        assert cancelled and caller.cancelled()
        await cancel_and_wait([task], "test")

    asyncio.run(scenario())


def test_gather_or_cancel_returns_in_order_and_the_first_failure_cancels_the_rest():
    async def scenario():
        never = asyncio.Event()
        cancelled = []

        async def slow(value, turns):
            for _ in range(turns):
                await asyncio.sleep(0)
            return value

        async def waits_for_ever():
            try:
                await never.wait()
            finally:
                cancelled.append(True)

        async def fails():
            await asyncio.sleep(0)
            raise LookupError("no such source")

        # the first finishes last: results come in the order of the works, not of their ends
        assert await gather_or_cancel(slow("a", 5), slow("b", 1), what="test") == ["a", "b"]
        assert await gather_or_cancel(what="test") == []
        with pytest.raises(LookupError, match="no such source"):  # the exception itself, not wrapped
            await gather_or_cancel(waits_for_ever(), fails(), what="test")
        assert cancelled == [True]

        # a work cancelled from elsewhere ends the wait too, and the others with it
        victim = asyncio.ensure_future(waits_for_ever())
        asyncio.get_running_loop().call_soon(victim.cancel)
        with pytest.raises(asyncio.CancelledError):
            await gather_or_cancel(victim, waits_for_ever(), what="test")
        assert cancelled == [True, True, True]

    asyncio.run(scenario())


def test_retry_with_backoff_calls_until_it_works_doubling_the_wait_and_saying_each_failure(caplog, monkeypatch):
    waits = []

    async def no_wait(seconds):  # the waits are recorded, not slept: what is checked is their sequence
        waits.append(seconds)

    async def scenario():
        calls = []

        async def attempt():
            calls.append(len(calls))
            if len(calls) < 4:
                raise ConnectionError(f"no peer answered ({len(calls)})")
            return "joined"

        monkeypatch.setattr(asyncio, "sleep", no_wait)
        return await retry_with_backoff(attempt, "rejoin", first_s=2.0, max_s=5.0), calls

    with caplog.at_level(logging.WARNING, logger="node.aio"):
        (result, attempts), calls = asyncio.run(scenario())
    assert (result, attempts, len(calls)) == ("joined", 4, 4)
    assert waits == [2.0, 4.0, 5.0, 5.0]  # doubled, and capped at max_s
    failures = [r.getMessage() for r in caplog.records]
    assert failures == [
        "rejoin attempt 1 failed (ConnectionError: no peer answered (1)); next in 4 s",
        "rejoin attempt 2 failed (ConnectionError: no peer answered (2)); next in 5 s",
        "rejoin attempt 3 failed (ConnectionError: no peer answered (3)); next in 5 s",
    ]


def test_retry_with_backoff_ends_with_its_caller():
    async def scenario():
        async def never_works():
            raise ConnectionError("down")

        task = asyncio.create_task(retry_with_backoff(never_works, "rejoin", first_s=0.01, max_s=0.01))
        await asyncio.sleep(0.1)  # some attempts fail meanwhile
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())
