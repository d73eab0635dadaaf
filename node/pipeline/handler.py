"""The wire side of a stage server: one call per p2p stream in, a RESULT or a REFUSE frame out.

As Petals' handler (src/petals/server/handler.py): read and check the call, hand it to the
backend, write the answer. Every call is checked before torch sees it: the frame, the message
(`protocol.pipeline`), the stage and its fingerprint, the server's state, the parts asked for;
the backend checks the tensors. A bad call gets a REFUSE frame with a `PipelineRefusal` (or
protocol `Refusal`) code, counted by reason and by peer; nothing raises out of the handler.
The torch work runs in one worker thread, one call at a time (`torch_lock`), so the event
loop keeps answering the DHT and new streams while a step runs. A step call is applied once per
caller and call id: a driver whose stream broke before the answer came asks again and gets the
first answer (a step is not idempotent, and the driver cannot tell whether it was applied); so is a
backward call (its gradients accumulate), for the last few.

A chained forward or backward (protocol/pipeline.py, "Chained calls") is served the same way, under
the chain's origin instead of the stream's peer, and then passed on to the next hop of its route
(`onward`, which the server provides: it finds that hop's server in the stage announcements and calls
it) before the caller gets its answer; the last hop of a forward keeps its output until its origin
collects it. The torch worker is free while the onward call runs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import resource
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable
from typing import Callable

import msgpack

from node.pipeline.backend import BackendRefused, StageBackend
from node.pipeline.client import CONTROL_MAX_BYTES, HopFailed, unpack
from node.pipeline.tensors import to_wire
from node.stats import LogThrottle, SwarmStats
from node.transport.framing import FramingError, OversizedFrame, read_frame, write_frame
from protocol import ProtocolRejection
from protocol.bounded import BoundedDict
from protocol.pipeline import (
    PIPELINE_VERSION,
    PipelineFrame,
    PipelineLimits,
    RouteHop,
    StageCall,
    StageResult,
    WireTensor,
    refusal_body,
)
from protocol.refusals import PipelineRefusal, Refusal

log = logging.getLogger(__name__)

READ_TIMEOUT_S = 30.0  # a caller that opens a stream must send its call within this
STEPS_REMEMBERED = 64  # step answers kept for a caller's retry of the same call (each is a few numbers)
# backward answers kept for a caller's retry of the same call: each holds the gradient of a micro-batch's hidden states
# (1 MB at 27M parameters), and a driver sends a call again at once, so a few recent ones are enough
BACKWARDS_REMEMBERED = 4
# outputs of chains' last hops waiting for their driver's `collect`, which follows at once: a few drivers' micro-batches
# in flight (logits: vocabulary x tokens each, so not many)
OUTPUTS_KEPT = 8
REFUSAL_LOG_EVERY_S = 60.0
# Where a served call's seconds go, summed by op in StageHandler.call_seconds: "read" from the stream's opening to the
# call decoded (the caller's bytes arriving), "lock" waiting for the torch worker, "compute" the work under it, "checks"
# the rest of serving (the call's checks, the result's tensors to bytes), "onward" a chained call's wait for the rest
# of its route, "reply" packing and writing the result.
CALL_PHASES = ("read", "lock", "compute", "checks", "onward", "reply")
# Beside the phases, what the torch work did on its worker thread: "compute_cpu" its CPU seconds (below "compute" when
# the thread waits: for a core, for the GIL) and "compute_faults" its minor page faults (memory touched for the first
# time since the allocator took it from the system): a slow call is told apart from a call kept waiting.
COMPUTE_WORK = ("compute_cpu", "compute_faults")


def _worker_usage() -> tuple[float, int]:
    """This thread's CPU seconds and minor page faults so far. The CPU from CLOCK_THREAD_CPUTIME_ID, not getrusage:
    the kernel's rusage of a running thread lags by up to a scheduler tick, so a short call could read more CPU
    than wall time, or none."""
    return time.thread_time(), resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


class StageHandler:
    """Serves the pipeline calls of whatever stage the server currently holds (`backend`, `fingerprint`, `state`)."""

    def __init__(self, limits: PipelineLimits) -> None:
        self.limits = limits
        self.backend: StageBackend | None = None
        self.fingerprint = ""
        self.state = (
            "spare"  # serving | loading | spare: only a serving stage runs calls; a loading one still lends its weights
        )
        self.stats = SwarmStats()  # refusals by peer and reason, shown by /metrics with the node's one renderer
        self.calls: Counter[str] = Counter()
        # op -> CALL_PHASES -> seconds, and "calls": how many calls they are of
        self.call_seconds: defaultdict[str, Counter[str]] = defaultdict(Counter)
        self.torch_lock = asyncio.Lock()
        self.before_step: Callable[[], None] = lambda: None  # e.g. apply a finished averaging round between steps
        self.after_step: Callable[[int], None] = lambda step: None  # e.g. start an averaging round
        self.refusal_log_throttle = LogThrottle(REFUSAL_LOG_EVERY_S)
        # (caller, call id) -> the answer of a step applied: a retried step call is answered, not applied again
        self.steps_answered: BoundedDict[tuple[str, str], StageResult] = BoundedDict(STEPS_REMEMBERED)
        # the same for backward calls: a repeat whose first answer was lost must not accumulate the gradients twice
        self.backwards_answered: BoundedDict[tuple[str, str], StageResult] = BoundedDict(BACKWARDS_REMEMBERED)
        # calls the next hop of a chained call (the server sets it: it reads the stage announcements, it has the p2p
        # daemon); None: chained calls with a route onward are refused
        self.onward: Callable[[RouteHop, StageCall], Awaitable[StageResult]] | None = None
        # (origin, call id) -> the output of a chain's last hop, until the origin collects it
        self.outputs: BoundedDict[tuple[str, str], WireTensor] = BoundedDict(OUTPUTS_KEPT)

    async def handle(self, stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = stream_info.peer_id.to_base58()
        opened = time.perf_counter()
        try:
            try:
                kind, body = await asyncio.wait_for(
                    read_frame(
                        reader,
                        PipelineFrame,
                        lambda k: self.limits.frame_limit() if k is PipelineFrame.CALL else CONTROL_MAX_BYTES,
                    ),
                    READ_TIMEOUT_S,
                )
                if kind is not PipelineFrame.CALL:
                    raise BackendRefused(Refusal.BAD_STRUCTURE, f"expected CALL, got {kind.name}")
                try:
                    call = StageCall.from_wire(unpack(body, self.limits), self.limits)
                except ValueError as exc:  # msgpack's errors are ValueErrors
                    raise BackendRefused(Refusal.NOT_MSGPACK, str(exc)) from None
                except ProtocolRejection as exc:
                    raise BackendRefused(exc.reason, exc.detail) from None
                decoded = time.perf_counter()
                timing: dict[str, float] = {}
                result = await self.serve(peer, call, timing)
                onward_started = time.perf_counter()
                if call.chained:
                    result = await self.pass_on(call, result)
                timing["onward"] = time.perf_counter() - onward_started
            except OversizedFrame as exc:
                raise BackendRefused(Refusal.TOO_LARGE, str(exc)) from None
            except FramingError as exc:
                raise BackendRefused(Refusal.BAD_STRUCTURE, str(exc)) from None
            served = time.perf_counter()
            self.calls[call.op] += 1
            await write_frame(writer, PipelineFrame.RESULT, msgpack.packb(result.to_wire(), use_bin_type=True))
            seconds = self.call_seconds[call.op]
            seconds["read"] += decoded - opened
            seconds["lock"] += timing.get("lock", 0.0)
            seconds["compute"] += timing.get("compute", 0.0)
            for key in COMPUTE_WORK:
                seconds[key] += timing.get(key, 0)
            seconds["onward"] += timing["onward"]
            seconds["checks"] += (
                served - decoded - timing.get("lock", 0.0) - timing.get("compute", 0.0) - timing["onward"]
            )
            seconds["reply"] += time.perf_counter() - served
            seconds["calls"] += 1  # the calls these seconds are of (a call whose reply broke is in `calls` alone)
        except BackendRefused as refused:
            if refused.reason is not PipelineRefusal.ONWARD_FAILED:  # another server failed, not this caller
                self.stats.refusals.record(peer, refused.reason)
            self._log_refusal(peer, refused)
            try:
                await write_frame(
                    writer, PipelineFrame.REFUSE, msgpack.packb(refusal_body(refused.reason, refused.detail))
                )
            except (ConnectionError, OSError):
                pass
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError, OSError) as exc:
            self.calls["broken_stream"] += 1
            log.debug("pipeline call from %s broke: %s", peer[:12], exc)
        finally:
            writer.close()

    async def serve(self, peer: str, call: StageCall, timing: dict[str, float] | None = None) -> StageResult:
        """Run one checked call on the backend; BackendRefused for a call this server does not serve. `timing`, if
        given, gets the seconds spent waiting for the torch worker ("lock") and working under it ("compute"), and what
        the work cost its worker thread (COMPUTE_WORK). A chained call runs under its origin (`chain_caller`)."""
        caller = chain_caller(peer, call)
        backend = self.backend
        if backend is None or call.stage != backend.index or call.stage_fingerprint != self.fingerprint:
            raise BackendRefused(
                PipelineRefusal.WRONG_STAGE,
                f"this server serves stage {backend.index if backend else -1} ({self.fingerprint or 'none yet'})",
            )
        if self.state != "serving" and call.op != "weights":
            raise BackendRefused(PipelineRefusal.NOT_READY, f"state {self.state}")
        held = backend.held_parts() if call.op == "weights" else backend.owned_parts()
        missing = [p for p in call.parts if p not in held]
        if missing:
            raise BackendRefused(PipelineRefusal.MISSING_PART, f"this server holds {sorted(held)}, not {missing}")
        if call.op == "collect":
            output = self.outputs.pop((peer, call.call_id), None)
            if output is None:
                raise BackendRefused(PipelineRefusal.UNKNOWN_CALL, f"no output {call.call_id!r} kept for this caller")
            return self._result(backend, {}, wire_tensors={"output": output})
        backend.expire()
        waiting = time.perf_counter()
        async with self.torch_lock:
            locked = time.perf_counter()
            if timing is not None:
                timing["lock"] = locked - waiting
            if self.backend is not backend:  # the server moved to another stage while this call waited
                raise BackendRefused(PipelineRefusal.WRONG_STAGE, "this server changed stage")
            work = timing if timing is not None else {}
            try:
                if call.op == "weights":
                    weights = await asyncio.to_thread(_measured, work, backend.weights, call.parts)
                    return self._result(backend, {}, weights=weights)
                if call.op == "step":
                    answered = self.steps_answered.get((peer, call.call_id))
                    if answered is not None:
                        return answered
                    self.before_step()
                    if await asyncio.to_thread(_measured, work, backend.apply_step, call.scale, call.lr_scale):
                        self.after_step(backend.step)
                    self.steps_answered[(peer, call.call_id)] = result = self._result(backend, {})
                    return result
                if call.op == "backward":
                    answered = self.backwards_answered.get((caller, call.call_id))
                    if answered is not None:
                        return answered
                    tensors = await asyncio.to_thread(_measured, work, backend.backward, caller, call)
                    self.backwards_answered[(caller, call.call_id)] = result = self._result(backend, tensors)
                    return result
                run = {
                    "forward": backend.forward,
                    "infer": backend.infer,
                    "end_session": backend.end_session,
                }[call.op]
                tensors = await asyncio.to_thread(_measured, work, run, caller, call)
            except BackendRefused:
                raise
            except Exception as exc:  # noqa: BLE001 - a compute error is refused to the caller, logged here, and the server lives on
                log.exception("stage %d: %s call failed", backend.index, call.op)
                raise BackendRefused(PipelineRefusal.FAILED, f"{type(exc).__name__}: {exc}") from None
            finally:
                if timing is not None:
                    timing["compute"] = time.perf_counter() - locked
        return self._result(backend, tensors)

    async def pass_on(self, call: StageCall, result: StageResult) -> StageResult:
        """The rest of a chained call, once this hop ran: keep a last forward's output for its origin, or call the next
        hop with this one's output (forward) or input gradient (backward) and the rest of the route. The caller gets
        this hop's result without its tensors (they went on), or ONWARD_FAILED."""
        bare = dataclasses.replace(result, tensors={})
        if call.op == "forward":
            if not call.route:
                self.outputs[(call.origin, call.call_id)] = result.tensors["output"]
                return bare
            tensors = {
                "hidden": result.tensors["output"],
                "position_ids": call.tensors["position_ids"],
                "attention_mask": call.tensors["attention_mask"],
            }
        else:
            if not call.route:
                return result
            if "grad" not in result.tensors:
                raise BackendRefused(Refusal.BAD_VALUE, "a backward route goes on past the hop that took token ids")
            tensors = {"grad": result.tensors["grad"]}
        if self.onward is None:
            raise BackendRefused(PipelineRefusal.ONWARD_FAILED, "this server does not pass calls on")
        hop = call.route[0]
        onward = StageCall(
            v=PIPELINE_VERSION,
            op=call.op,
            stage=hop.stage,
            stage_fingerprint=hop.stage_fingerprint,
            call_id=hop.call_id,
            parts=list(hop.parts),
            train=call.train,
            tensors=tensors,
            scale=1.0,
            origin=call.origin,
            route=list(call.route[1:]),
        )
        try:
            await self.onward(hop, onward)
        except HopFailed as failure:
            raise BackendRefused(PipelineRefusal.ONWARD_FAILED, str(failure)) from None
        return bare

    @staticmethod
    def _result(
        backend: StageBackend, tensors: dict, weights: bytes | None = None, wire_tensors: dict | None = None
    ) -> StageResult:
        return StageResult(
            v=PIPELINE_VERSION,
            tensors=wire_tensors if wire_tensors is not None else {k: to_wire(t) for k, t in tensors.items()},
            weights=weights,
            step=backend.step,
            grad_norm=float(backend.grad_norm),
            lr_scale=float(backend.lr_scale),
        )

    def _log_refusal(self, peer: str, refused: BackendRefused) -> None:
        """At most one log line per peer and reason a minute: a flood of bad calls must not flood the log."""
        if self.refusal_log_throttle.due(peer, refused.reason.value):
            log.info("refused a pipeline call from %s: %s: %s", peer[:12], refused.reason.value, refused.detail)


def chain_caller(peer: str, call: StageCall) -> str:
    """Whom a call's forward is kept for: the stream's peer, or for a chained call its origin (its backward comes from
    the other neighbour). The prefix keeps a chain's entries apart from any peer's direct calls."""
    return f"chain:{call.origin}" if call.chained else peer


def _measured(work: dict, run: Callable, *args):
    """run(*args) on this (worker) thread, adding its CPU seconds and minor page faults to `work` (COMPUTE_WORK)."""
    cpu, faults = _worker_usage()
    try:
        return run(*args)
    finally:
        cpu_after, faults_after = _worker_usage()
        work["compute_cpu"] = work.get("compute_cpu", 0.0) + cpu_after - cpu
        work["compute_faults"] = work.get("compute_faults", 0) + faults_after - faults
