"""Ending the node's background tasks at shutdown, and stopping loudly when one of them dies.

Python 3.11's `asyncio.wait_for` returns its result instead of raising when a cancellation
arrives in the same loop iteration as the awaited future's result (fixed in 3.12). A service
loop around such a call then runs on after `task.cancel()`, and a shutdown that waits for it
never ends: beside a CPU hog, a node's heartbeat loop kept running after Ctrl-C and the
node's shutdown waited on it until the test killed the node (tests/test_swarm.py, 60 s).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

RECANCEL_EVERY_S = 1.0  # a task in its own cleanup gets this long before it is cancelled again


class StopRequested(Exception):
    """A wait that may never end (a pipeline driver's for a lost stage) ended because the process is to stop."""


class ServiceDied(RuntimeError):
    """A background service that `run_supervised` watched died of an exception (the cause): the part to restart."""


async def cancel_and_wait(tasks: Iterable[asyncio.Task], what: str, grace_s: float = 15.0) -> None:
    """Cancel `tasks` and wait for them to end, cancelling again each RECANCEL_EVERY_S while
    one still runs. After `grace_s` the stragglers are left running, with a warning."""
    tasks = list(tasks)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace_s
    pending = {task for task in tasks if not task.done()}
    while pending:
        left = deadline - loop.time()
        if left <= 0:
            log.warning(
                "%s: %d task(s) still running %.0f s after being cancelled; leaving them", what, len(pending), grace_s
            )
            break
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=min(RECANCEL_EVERY_S, left))
    for task in tasks:  # an exception a task ended with is retrieved here, not reported as never retrieved
        if task.done() and not task.cancelled() and task.exception() is not None:
            log.debug("%s: a task ended with %r", what, task.exception())


async def gather_or_cancel(*works: Awaitable[T], what: str) -> list[T]:
    """Run `works` at once and return their results in order. The first to fail (an exception, or a cancellation from
    elsewhere) cancels the others and its exception is raised as it is: asyncio.gather would leave the others running,
    and a TaskGroup would wrap the exception in an ExceptionGroup that callers catching it by type would miss."""
    tasks = [asyncio.ensure_future(work) for work in works]
    try:
        pending = set(tasks)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in (t for t in tasks if t in done):
                if task.cancelled():
                    raise asyncio.CancelledError(f"{what}: one was cancelled")
                if task.exception() is not None:
                    raise task.exception()
        return [task.result() for task in tasks]
    finally:
        # every task, finished ones included: a second failure in the same turn is retrieved, not logged as lost
        await cancel_and_wait(tasks, what)


async def run_supervised(work: Awaitable[T], services: Iterable[asyncio.Task], what: str) -> T:
    """Await `work` while the background `services` run. If one of them dies of an exception first, `work` is
    cancelled and ServiceDied raised from that exception: the caller restarts what died, or stops loudly instead of
    leaving the process to limp on. Cancelling the caller cancels `work` too."""
    main = asyncio.ensure_future(work)
    watched = set(services)
    try:
        while True:
            done, watched = await asyncio.wait({main, *watched}, return_when=asyncio.FIRST_COMPLETED)
            if main in done:
                return main.result()
            watched.discard(main)
            for task in done:
                if not task.cancelled() and task.exception() is not None:
                    raise ServiceDied(f"{what}: the {task.get_name()} service died") from task.exception()
    finally:
        if not main.done():
            await cancel_and_wait([main], what)


async def retry_with_backoff(
    attempt: Callable[[], Awaitable[T]], what: str, first_s: float, max_s: float
) -> tuple[T, int]:
    """Call `attempt` until it returns, waiting `first_s` before the first call and twice as long after each failure,
    at most `max_s`; each failure is one warning line. Its result and the number of calls. Cancelling the caller ends
    the wait or the call in flight."""
    delay, calls = first_s, 0
    while True:
        await asyncio.sleep(delay)
        calls += 1
        try:
            return await attempt(), calls
        except Exception as exc:  # noqa: BLE001 - the network's answer, most often: tried again, said once a call
            delay = min(max_s, 2 * delay)
            log.warning("%s attempt %d failed (%s: %s); next in %.0f s", what, calls, type(exc).__name__, exc, delay)
