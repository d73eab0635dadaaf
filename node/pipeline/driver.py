"""The driver: sends micro-batches through a route of live stage servers and steps them.

Routing (SWARM parallelism, NoLoCo's random routing): every micro-batch picks one random
live server per stage, so replicas of a stage share the load and none is a fixed
neighbour of another. The backward retraces the forward's route, hop by hop in reverse;
each server accumulates its gradients, and at the end of the step the driver asks every
server it used to apply them (`step`). A call whose stream broke is first sent again to the
same server (`call_until_answered`: under load a stream may end inside a live server's answer).
A hop that fails (no answer within `call_timeout_s`, a stream that broke on every try, a
refusal) puts its server on an avoid list for `avoid_s` and the micro-batch is tried again on
a fresh route; a stage with no server
left to try is *lost*: the driver abandons the step (servers drop what they accumulated),
waits until a server announces the stage again (a spare, a joining node or a moving replica
that rebuilt it, see recovery.py and selection.py), and records the recovery: cause, the new
server, and the seconds from detection to the first step after it. While it waits it
publishes a signed `StageLost` report of the stages it misses (choosers then stop counting
their dead servers' last announcements, and `peers --stages` marks them lost) and logs which
stages it waits for, every `WAIT_LOG_EVERY_S`. A stop the command was asked for (its `stop` event: Ctrl-C, SIGTERM)
ends the wait at once with `StopRequested`: a stage may never come back.

Direct hops (pipeline.direct_hops, SWARM's way): a forward goes out as one chained call to the
first hop's server, which passes its output on to the next and so on (protocol/pipeline.py,
"Chained calls"); the driver then collects the last hop's output from its server, and the
backward goes the same way in reverse. A chain that fails is sent again hop by hop on the same
route, which finds the server at fault as above; when hop by hop succeeds where chains broke between
servers (twice in a row), the servers cannot reach each other, and the driver goes hop by hop for
`CHAIN_PAUSE_S`. A backward
is not sent twice (its gradients accumulate): a chained backward that fails counts as a failed
backward, as a hop-by-hop one does.

CheckFree+ (pipeline.checkfree_plus): on one micro-batch in `checkfree_plus_swap_every` (every odd one by default)
the first two and the last two stages run in swapped order (`route_order`; the first two only with
`checkfree_plus_swap_last` off), so that stage 1 learns to stand in for stage 0 and stage S-2 for stage S-1; the
embedding still runs first (on stage 0) and the head last (on stage S-1).
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import secrets
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import torch

from node.aio import StopRequested
from node.config import NodeConfig
from node.pipeline.client import HopFailed, call_stage, handler_name, until_answered
from node.pipeline.selection import lost_report, stages_to_report
from node.pipeline.stagemap import LostReporter, StageMap, read_stage_map
from node.pipeline.tensors import from_wire, to_wire
from protocol import StageAnnouncement
from protocol.pipeline import PIPELINE_VERSION, PipelineLimits, RouteHop, StageCall, StageResult
from protocol.bounded import BoundedDict

log = logging.getLogger(__name__)

STRIKES = 2  # failed hops in a row before a server is avoided: a single reset stream is not a dead server
WAIT_LOG_EVERY_S = 15.0  # a driver waiting for a lost stage says so this often
CHAIN_PAUSE_S = 60.0  # hop by hop for this long after a chain failed where the same route hop by hop did not
ONWARD_FAILED = "refused:onward_failed"  # HopFailed.reason of a chain that broke after its first hop


def route_order(num_stages: int, micro_batch: int, swap: bool, every: int = 2, last_pair: bool = True) -> list[int]:
    """The order in which the stages' LAYERS run for this micro-batch (counted over the run, not the step): with
    `swap`, micro-batches every-1, 2*every-1, ... run with stages 0/1 swapped, and S-2/S-1 too with `last_pair`."""
    order = list(range(num_stages))
    if not swap or micro_batch % every != every - 1 or num_stages < 2:
        return order
    if num_stages == 2:
        return [1, 0]
    if num_stages == 3:  # the two pairs overlap: alternate between them
        pair = (0, 1) if (micro_batch // every) % 2 == 0 or not last_pair else (1, 2)
        order[pair[0]], order[pair[1]] = order[pair[1]], order[pair[0]]
        return order
    order[0], order[1] = 1, 0
    if last_pair:
        order[-2], order[-1] = num_stages - 1, num_stages - 2
    return order


def route_hops(num_stages: int, order: list[int]) -> list[tuple[int, list[str]]]:
    """(stage, parts) calls for one pass: embed on stage 0, LAYERS in `order`, head on stage S-1; same-stage neighbours
    merged."""
    hops: list[tuple[int, list[str]]] = (
        [(0, ["embed"])] + [(stage, ["layers"]) for stage in order] + [(num_stages - 1, ["head"])]
    )
    merged: list[tuple[int, list[str]]] = []
    for stage, parts in hops:
        if merged and merged[-1][0] == stage:
            merged[-1][1].extend(parts)
        else:
            merged.append((stage, list(parts)))
    return merged


class StageLost(Exception):
    """No live server of `stage` is left to try."""

    def __init__(self, stage: int, cause: str) -> None:
        super().__init__(f"stage {stage} has no live server ({cause})")
        self.stage = stage
        self.cause = cause


@dataclass
class StepOutcome:
    """What a `step` call to the servers of a step came back with."""

    grad_norms: dict[int, float] = field(default_factory=dict)  # per stage, from the servers that answered
    # node id -> a server whose call failed (HopFailed): it applied it, or still holds its gradients, or is gone
    unanswered: dict[str, StageAnnouncement] = field(default_factory=dict)


class PipelineRouter:
    """Calls into the pipeline of one model: routes, retries, avoidance, stage-map refresh."""

    def __init__(
        self,
        dht,
        config: NodeConfig,
        model_fingerprint: str,
        stage_fingerprints: list[str],
        limits: PipelineLimits,
        seed: int = 0,
        reporter: LostReporter | None = None,
        stop: asyncio.Event | None = None,
    ) -> None:
        self.dht = dht
        self.reporter = reporter  # publishes our lost reports (None: this router reports nothing)
        # set when the command is to stop: it ends a wait for a lost stage
        self.stop = stop if stop is not None else asyncio.Event()
        self.config = config
        self.pipeline = config.pipeline
        self.model_fingerprint = model_fingerprint
        self.fingerprints = stage_fingerprints
        self.limits = limits
        self.handler = handler_name(config.swarm.swarm_id, model_fingerprint)
        self.rng = random.Random(seed)
        self.map = StageMap(self.pipeline.num_stages)
        self._map_read_at = -1e9
        # stage -> node ids of its servers at the last read that showed it served: who served a stage before it was
        # lost, even once their announcements have aged out of the map (or a lost report has struck them from it)
        self.last_served: dict[int, frozenset[str]] = {}
        self.avoid: dict[str, float] = {}  # node id -> monotonic time until which it is left out
        # node id -> unix time of the failure that put it on the avoid list (compared with its announcements)
        self.failed_at: BoundedDict[str, float] = BoundedDict(4096)
        self.lost_at: dict[int, float] = {}  # what our lost report names: stage -> unix time we found it lost
        self.strikes: BoundedDict[str, int] = BoundedDict(4096)  # node id -> hops failed in a row
        self.hop_failures: Counter[str] = Counter()
        self.repeated: Counter[str] = Counter()  # op -> calls sent again after their stream broke
        self.wrong_fingerprint = 0
        # call prefix -> the random part of a chained forward's call ids, until its backward (which must go chained too:
        # its servers keep the forward under the chain's origin)
        self.chained: BoundedDict[str, str] = BoundedDict(4096)
        self.chain_fallbacks = 0  # chains that failed and were sent hop by hop
        self.chain_paused_until = 0.0  # monotonic time until which forwards go hop by hop
        self.chain_strikes = 0  # chains in a row that broke between servers that all answered hop by hop

    def rebind(self, dht, reporter: LostReporter | None) -> None:
        """Route over another session's DHT (the driver rejoined the swarm): who served each stage is kept, the stage
        map is read again before the next call. The failures its calls met are forgotten: they were, for all it
        knows, the dead connection's, and a server avoided for them would keep its stage from being served, or be
        reported lost, for nothing."""
        self.dht, self.reporter = dht, reporter
        self._map_read_at = -1e9
        self.avoid.clear()
        self.strikes.clear()
        self.failed_at.clear()

    async def refresh(self, force: bool = False) -> StageMap:
        """The stage map, read again when `force` or older than an announce interval. A DHT that was shut down (its
        session closed: this process rejoins the swarm) is not read: nothing is served over it until `rebind`."""
        now = time.monotonic()
        if not getattr(self.dht, "is_alive", True):
            self.map = StageMap(self.pipeline.num_stages)
            return self.map
        if force or now - self._map_read_at >= self.pipeline.announce_interval_s:
            stage_map = await read_stage_map(self.dht, self.config, self.model_fingerprint)
            for stage, servers in stage_map.servers.items():
                good = [s for s in servers if s.stage_fingerprint == self.fingerprints[stage]]
                self.wrong_fingerprint += len(servers) - len(good)
                # a server a driver reported dead and that has not announced since is not routed to
                lost_at = stage_map.lost.get(stage)
                stage_map.servers[stage] = [
                    s for s in good if lost_at is None or stage_map.signed_at.get(s.node_id, lost_at + 1) > lost_at
                ]
                if stage_map.servers[stage]:
                    self.last_served[stage] = frozenset(s.node_id for s in stage_map.servers[stage])
            self.map, self._map_read_at = stage_map, now
        return self.map

    def avoided(self) -> set[str]:
        now = time.monotonic()
        for node_id in [n for n, until in self.avoid.items() if until <= now]:
            del self.avoid[node_id]
        return set(self.avoid)

    def fail(self, failure: HopFailed) -> None:
        """Count a failed hop; leave its server out of routes after STRIKES failures in a row (one may be a reset
        stream). A chain that broke further on is not its first server's fault."""
        node_id = failure.server.node_id
        self.hop_failures[failure.reason] += 1
        if failure.reason == ONWARD_FAILED:
            log.info("chained call failed further on: %s", failure)
            return
        self.strikes[node_id] = self.strikes.get(node_id, 0) + 1
        if self.strikes[node_id] >= STRIKES or failure.reason == "timeout":
            self.avoid[node_id] = time.monotonic() + self.pipeline.avoid_s
            self.failed_at[node_id] = time.time()
            self.strikes.pop(node_id, None)
        log.info("hop failed: %s", failure)

    def succeeded(self, servers) -> None:
        for server in servers:
            self.strikes.pop(server.node_id, None)

    async def pick_route(self, hops: list[tuple[int, list[str]]]) -> dict[int, StageAnnouncement]:
        stage_map = await self.refresh()
        route = {}
        for stage in sorted({stage for stage, _ in hops}):
            server = stage_map.pick(stage, self.rng, self.avoided())
            if server is None:
                stage_map = await self.refresh(force=True)
                server = stage_map.pick(stage, self.rng, self.avoided())
            if server is None:
                cause = "calls failing" if stage_map.live(stage) else "no announcement"
                raise StageLost(stage, cause)
            route[stage] = server
        return route

    def _call(
        self,
        op: str,
        server: StageAnnouncement,
        call_id: str,
        parts: list[str] = (),
        train: bool = False,
        tensors: dict | None = None,
        scale: float = 1.0,
        route: list[RouteHop] | None = None,
    ) -> StageCall:
        """One call to `server`; with a `route` (empty for a chain of one hop), a chained one from this driver."""
        return StageCall(
            v=PIPELINE_VERSION,
            op=op,
            stage=server.stage,
            stage_fingerprint=self.fingerprints[server.stage],
            call_id=call_id,
            parts=list(parts),
            train=train,
            tensors={k: to_wire(v) for k, v in (tensors or {}).items()},
            scale=scale,
            origin=self.dht.peer_id.to_base58() if route is not None else "",
            route=list(route or []),
        )

    async def call(self, server: StageAnnouncement, call: StageCall, timeout: float | None = None):
        return await call_stage(
            self.dht.p2p, self.handler, server, call, self.limits, timeout or self.pipeline.call_timeout_s
        )

    async def call_until_answered(
        self, server: StageAnnouncement, call: StageCall, timeout: float | None = None
    ) -> StageResult:
        """`call`, sent again to the same server while its stream breaks (client.until_answered). Sent to another
        route instead, a forward cost every earlier hop again, and a lost backward answer cost the earlier stages
        that micro-batch's gradient."""

        def repeat(failure: HopFailed) -> None:
            self.repeated[call.op] += 1
            log.info("%s call to stage %d broke (%s); sending it again", call.op, server.stage, failure.detail)

        return await until_answered(lambda: self.call(server, call, timeout), repeat)

    def chaining(self) -> bool:
        return self.pipeline.direct_hops and time.monotonic() >= self.chain_paused_until

    @staticmethod
    def _chain_ids(call_prefix: str, nonce: str, hops) -> list[str]:
        """A chain's call ids, one a hop: its forward's and, the same, its backward's."""
        return [f"{call_prefix}-{nonce}-{k}" for k in range(len(hops))]

    def _onward(self, route, hops, ids: list[str], order) -> list[RouteHop]:
        return [
            RouteHop(
                stage=hops[k][0],
                stage_fingerprint=self.fingerprints[hops[k][0]],
                peer_id=route[hops[k][0]].p2p_peer_id,
                call_id=ids[k],
                parts=list(hops[k][1]),
            )
            for k in order
        ]

    async def forward(
        self,
        route: dict[int, StageAnnouncement],
        hops,
        call_prefix: str,
        input_ids,
        position_ids,
        attention_mask,
        train: bool,
    ) -> torch.Tensor:
        """The output of the last hop (logits): chained when `chaining()`, else (or when the chain failed) hop by
        hop."""
        if not self.chaining():
            return await self._forward_hops(route, hops, call_prefix, input_ids, position_ids, attention_mask, train)
        nonce = secrets.token_hex(6)
        try:
            output = await self._forward_chained(
                route, hops, self._chain_ids(call_prefix, nonce, hops), input_ids, position_ids, attention_mask, train
            )
        except HopFailed as failure:
            self.chain_fallbacks += 1
            log.info("chained forward failed (%s); sending it hop by hop", failure)
            output = await self._forward_hops(route, hops, call_prefix, input_ids, position_ids, attention_mask, train)
            # every server answered hop by hop, so a chain that broke after its first hop broke between them; twice in
            # a row, and they are taken not to reach each other (not a stream that broke once)
            self.chain_strikes = self.chain_strikes + 1 if failure.reason == ONWARD_FAILED else 0
            if self.chain_strikes >= STRIKES:
                self.chain_strikes = 0
                self.chain_paused_until = time.monotonic() + CHAIN_PAUSE_S
                log.warning(
                    "chained forwards failed where the same routes hop by hop did not (%s): hop by hop for %.0fs",
                    failure,
                    CHAIN_PAUSE_S,
                )
            return output
        self.chain_strikes = 0
        if train:
            self.chained[call_prefix] = nonce
        return output

    async def _forward_chained(
        self, route, hops, ids: list[str], input_ids, position_ids, attention_mask, train: bool
    ) -> torch.Tensor:
        first, parts = hops[0]
        inputs = {"input_ids": input_ids, "position_ids": position_ids, "attention_mask": attention_mask}
        onward = self._onward(route, hops, ids, range(1, len(hops)))
        call = self._call("forward", route[first], ids[0], parts, train, inputs, route=onward)
        await self.call_until_answered(route[first], call, timeout=self.pipeline.call_timeout_s * len(hops))
        last = route[hops[-1][0]]
        result = await self.call_until_answered(last, self._call("collect", last, ids[-1]))
        if "output" not in result.tensors:
            raise HopFailed(last, "malformed", "a collect result without output")
        self.succeeded(route.values())
        return from_wire(result.tensors["output"])

    async def _forward_hops(
        self,
        route: dict[int, StageAnnouncement],
        hops,
        call_prefix: str,
        input_ids,
        position_ids,
        attention_mask,
        train: bool,
    ) -> torch.Tensor:
        x = input_ids
        for k, (stage, parts) in enumerate(hops):
            inputs = {
                "input_ids" if parts[0] == "embed" else "hidden": x,
                "position_ids": position_ids,
                "attention_mask": attention_mask,
            }
            result = await self.call_until_answered(
                route[stage], self._call("forward", route[stage], f"{call_prefix}-{k}", parts, train, inputs)
            )
            if "output" not in result.tensors:
                raise HopFailed(route[stage], "malformed", "a forward result without output")
            x = from_wire(result.tensors["output"])
        self.succeeded(route.values())
        return x

    async def backward(self, route: dict[int, StageAnnouncement], hops, call_prefix: str, grad: torch.Tensor) -> None:
        """The gradient of the last hop's output back through the route: chained if its forward was."""
        nonce = self.chained.pop(call_prefix, None)
        if nonce is not None:
            ids = self._chain_ids(call_prefix, nonce, hops)
            last = len(hops) - 1
            stage, parts = hops[last]
            call = self._call(
                "backward",
                route[stage],
                ids[last],
                parts,
                tensors={"grad": grad},
                route=self._onward(route, hops, ids, reversed(range(last))),
            )
            await self.call_until_answered(route[stage], call, timeout=self.pipeline.call_timeout_s * len(hops))
            return
        for k in reversed(range(len(hops))):
            stage, parts = hops[k]
            result = await self.call_until_answered(
                route[stage], self._call("backward", route[stage], f"{call_prefix}-{k}", parts, tensors={"grad": grad})
            )
            if parts[0] == "embed":
                break
            if "grad" not in result.tensors:
                raise HopFailed(route[stage], "malformed", "a backward result without grad")
            grad = from_wire(result.tensors["grad"])

    async def wait_until_served(self, on_missing: Callable[[int], None] | None = None) -> None:
        """Return once every stage has a live server that is not avoided (a lost one rebuilt, see recovery.py).
        Meanwhile: report the missing stages lost, say which ones we wait for every WAIT_LOG_EVERY_S, and call
        `on_missing(stage)` the first time each stage is found missing (a neighbour can die after the stage we
        noticed first). Raises StopRequested as soon as `stop` is set."""
        started = time.monotonic()
        said = reported = -math.inf
        dated: set[int] = set()  # stages found lost in this wait (they keep that time in our reports)
        noticed: set[int] = set()
        while True:
            await self.refresh(force=True)
            missing = self.missing_stages()
            if on_missing is not None:
                for stage in sorted(set(missing) - noticed):
                    on_missing(stage)
                noticed.update(missing)
            if not missing:
                return
            now = time.monotonic()
            lost = stages_to_report(self.map, missing, self.failed_at)
            self.lost_at = lost_report(self.lost_at, lost, dated, time.time(), self.pipeline.announce_ttl_s)
            dated.update(lost)
            if now - reported >= WAIT_LOG_EVERY_S / 3 and lost:
                await self.report_lost(self.lost_at)
                reported = now
            if now - said >= WAIT_LOG_EVERY_S:
                log.warning(
                    "waiting %.0fs for stage(s) %s: no live server answers (a spare, a `serve --stage auto` or a "
                    "moving replica rebuilds them)",
                    now - started,
                    ", ".join(map(str, missing)),
                )
                said = now
            try:
                await asyncio.wait_for(self.stop.wait(), self.pipeline.rebuild_poll_s)
            except asyncio.TimeoutError:
                continue
            raise StopRequested(f"stopped while waiting for stage(s) {', '.join(map(str, missing))}")

    async def report_lost(self, lost_at: dict[int, float]) -> None:
        """Publish our signed report of the stages whose every server failed, and since when (protocol.StageLost)."""
        if self.reporter is None:
            return
        try:
            await self.reporter.publish(lost_at)
        except Exception as exc:  # noqa: BLE001 - a report is a hint to choosers; the driver waits on whether it was stored or not
            log.warning("could not publish the lost report of stage(s) %s: %s", sorted(lost_at), exc)

    def missing_stages(self) -> list[int]:
        return [i for i in range(self.pipeline.num_stages) if not self.map.live(i, self.avoided())]

    async def step(self, servers: dict[str, StageAnnouncement], scale: float, step_id: str) -> StepOutcome:
        """Ask every server used in this step to apply (scale > 0) or drop (scale 0) its gradients: their grad norms,
        and the servers that did not answer.

        A step call whose stream broke is sent again, the same call: a server that applied it answers without applying
        it twice (StageHandler.steps_answered), and one that never received it applies it now. Without that, a server
        whose answer was lost keeps this step's gradients and adds them to the next one's."""
        calls = [self.call_until_answered(s, self._call("step", s, step_id, scale=scale)) for s in servers.values()]
        outcome = StepOutcome()
        for server, answer in zip(servers.values(), await asyncio.gather(*calls, return_exceptions=True)):
            if isinstance(answer, HopFailed):
                self.fail(answer)
                outcome.unanswered[server.node_id] = server
            elif isinstance(answer, BaseException):
                raise answer
            else:
                outcome.grad_norms[server.stage] = answer.grad_norm
        return outcome
