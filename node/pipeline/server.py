"""A stage server: one pipeline stage of a model no single node holds, served over p2p streams.

Why it looks like this. SWARM parallelism and Petals serve a model as stages announced in a
DHT; any number of servers may serve one stage, a client routes each micro-batch through
one server per stage and fails over when a hop fails. We do the same on the node's own
DHT and p2p daemon (as the averaging exchange does, `node/averaging/exchange.py`), with
the calls of `protocol/pipeline.py` framed by `node/transport/framing.py`:

    handler  swarm-node/v1/<swarm>/pipeline/<model fingerprint>/v1     (one call per stream)
    key      swarm-node/v1/<swarm>/stages                              (signed announcements)
    key      swarm-node/v1/<swarm>/stages-lost                         (drivers' lost reports)

As Petals splits its server, this one is split in five: `handler.py` (the wire: calls in,
refusals, replies), `backend.py` (the torch work, tested without a network), `selection.py`
(which stage to take and when to move, pure functions of the stage map), `recovery.py`
(where a stage's weights come from) and `stage_loading.py` (loading them: choosing the
sources, retrying, leaving out those that failed). This module is the life of a server
that ties them together (`run`):
1. pick its stage: an index, `auto` (a stage left without a live server first, else the
   least served), or `spare` (announce itself as a spare and wait for such a stage);
2. get the stage's weights from live nodes only (`stage_loading.py`): a replica's copy, else
   CheckFree from the neighbours, CheckFree+ for an end stage, else the initial model
   if the pipeline has not trained yet; announce "loading" meanwhile;
3. serve the calls (`handler.py`; a chained call goes on to the next hop's server, which this server
   finds in its own read of the announcements: `call_onward`), keep its CheckFree+ replica (stage 1: the embedding;
   stage S-2: the head) fresh by copying it from its owner every `replica_sync_every` steps,
   and average its weights with other replicas of its stage (NoLoCo/DiLoCo, keyed by the
   stage fingerprint) when averaging is on;
4. every announce interval, check whether to move (`selection.plan_move`): a replica of a
   stage served by several moves to a stage left empty for `rebalance_grace_s`, or where
   Petals' throughput rule says; it then takes up the new stage as in step 2.
A spare stays a spare once it has taken a stage: it does not return to waiting when the
stage later gains a second server (the issue left re-arming optional; a replica can still
move by rule 4, which covers what a re-armed spare would do).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time

from node.aio import cancel_and_wait
from node.device import resolve_device
from node.pipeline.backend import BackendRefused, StageBackend
from node.pipeline.client import HopFailed, call_stage, handler_name, until_answered
from node.pipeline.handler import StageHandler
from node.pipeline.recovery import RecoveryEvent
from node.pipeline.selection import (
    Move,
    choose_stage,
    fresh_window_s,
    live_view,
    plan_move,
    spare_assignment,
    update_empty_since,
)
from node.pipeline.stage_loading import StageLoader
from node.pipeline.stagemap import Announcer, StageMap, read_losses, read_stage_map, wait_for_lost_report
from node.pipeline.stages import (
    PipelineStage,
    StagePart,
    extra_parts_for,
    pipeline_limits,
    split_parts,
    stage_fingerprint,
    stage_plan,
)
from node.files import append_json_line, atomic_write_text
from node.stats import prometheus_text
from node.transport.session import SwarmSession
from protocol import DEFAULT_LIMITS, StageAnnouncement
from protocol.pipeline import RouteHop, StageCall, StageResult
from protocol.refusals import PipelineRefusal

log = logging.getLogger(__name__)


class StageServer:
    def __init__(self, session: SwarmSession, initial_model, model_fingerprint: str) -> None:
        """Serve a stage of `initial_model`'s pipeline over `session` (node/transport/session.py), which the caller
        opened and closes."""
        self.session = session
        self.config = config = session.config
        self.pipeline = config.pipeline
        self.identity = identity = session.identity
        self.dht = session.dht
        self.initial_model = (
            initial_model  # the initial policy: weights for a pipeline that has not trained yet, and the architecture
        )
        self.hf_config = initial_model.config
        self.model_fingerprint = model_fingerprint
        self.state_dir = session.state_dir
        self.plan = stage_plan(config, self.hf_config)
        # the stage this server serves trains here (model.device); it is built and loaded on the CPU, where the
        # initial model and the fetched weights are, and moved once loaded
        self.device = resolve_device(config.model)
        # the p2p stream protocol of this model's calls
        self.protocol = handler_name(config.swarm.swarm_id, model_fingerprint)
        self.limits = pipeline_limits(config, self.hf_config, sum(p.numel() for p in initial_model.parameters()))
        self.handler = StageHandler(self.limits)
        self.handler.onward = self.call_onward
        self.announcer = Announcer(session)
        self._rng = random.Random(identity.node_id)
        self.loader = StageLoader(session, self.protocol, self.limits, lambda: self.read_view(strict=False), self._rng)
        self.index: int = -1
        self.recoveries = 0
        self.moves = 0
        self.replicas: list[str] = []
        self.averaging = None
        self._tasks: set[asyncio.Task] = set()
        self._stopping = asyncio.Event()
        self._last_replica_sync = -1
        self._empty_since: dict[int, float] = {}  # stage -> when this server first saw it without a live server
        self._latest_map: StageMap | None = None  # the announce loop's last read of the stage map
        # chained calls' own read, when a hop names a server the announce loop's read does not have yet
        self._onward_map: StageMap | None = None
        self._onward_map_read_at = -1e9

    @property
    def state(self) -> str:
        return self.handler.state

    @property
    def backend(self) -> StageBackend | None:
        return self.handler.backend

    @property
    def step(self) -> int:
        return self.backend.step if self.backend else 0

    # choosing a stage and taking it up ---------------------------------------------------

    async def read_map(self) -> StageMap:
        return await read_stage_map(self.dht, self.config, self.model_fingerprint)

    async def read_view(self, strict: bool) -> tuple[StageMap, StageMap]:
        """(everything announced, what counts as live: see selection.live_view). `strict`: only announcements of the
        last
        few intervals count, as a newcomer judges holes (a wrong guess only makes it a replica); else anything within
        the
        TTL that no lost report superseded, as spares and moving replicas judge them (they must not act on a server that
        was only slow to announce on a loaded machine) and as a server loading its weights looks for sources (a source
        that does not answer is dropped then)."""
        stage_map = await self.read_map()
        fresh_s = (
            fresh_window_s(self.pipeline.announce_interval_s, self.pipeline.announce_ttl_s)
            if strict
            else self.pipeline.announce_ttl_s
        )
        return stage_map, live_view(stage_map, time.time(), fresh_s)

    async def choose_stage(self) -> tuple[int, str]:
        """(stage index, cause). A spare announces itself and waits for a stage with no live server."""
        wanted = self.pipeline.stage
        if isinstance(wanted, int):
            if not 0 <= wanted < self.plan.num_stages:
                raise ValueError(f"pipeline.stage {wanted} is outside [0, {self.plan.num_stages})")
            return wanted, "configured"
        if wanted == "auto":
            _, view = await self.read_view(strict=True)
            return choose_stage(view)
        log.info("spare: waiting for a stage whose last server dies")
        while not self._stopping.is_set():
            await self.announce()
            stage_map, view = await self.read_view(strict=False)
            stage = spare_assignment(view, self.identity.node_id)
            if stage is not None:
                return stage, "lost (a driver reported it)" if stage in view.lost else "no live server"
            # a driver's lost report wakes us within rebuild_poll_s; a silent death shows at the next whole read
            await wait_for_lost_report(
                lambda: read_losses(self.dht, self.config, self.model_fingerprint),
                stage_map.lost,
                self.pipeline.announce_interval_s / 2,
                self.pipeline.rebuild_poll_s,
            )
        raise asyncio.CancelledError

    async def acquire(self, index: int, cause: str) -> RecoveryEvent:
        """Take up stage `index`: announce it "loading", load its weights from the live swarm (stage_loading.py; never
        from disk), then serve it."""
        started = time.perf_counter()
        self.index = index
        self.handler.state = "loading"
        extra = extra_parts_for(self.config, index)
        stage = PipelineStage.from_model(self.initial_model, self.plan, index, extra_parts=extra)
        fingerprint = stage_fingerprint(self.model_fingerprint, self.plan, index, stage)
        self.handler.fingerprint = fingerprint
        await self.announce()
        event = await self.loader.load(
            stage, fingerprint, lambda: PipelineStage.from_config(self.hf_config, self.plan, index, extra)
        )
        event.cause = cause
        event.seconds = time.perf_counter() - started
        if event.method != "initial":
            self.recoveries += 1
        self.handler.backend = StageBackend(
            self.pipeline, self.hf_config, self.plan, stage.to(self.device), step=event.step, lr_scale=event.lr_scale
        )
        self.handler.state = "serving"
        self._last_replica_sync = -1
        self._log_event(event)
        await self.announce()
        return event

    def _log_event(self, event: RecoveryEvent) -> None:
        log.info(
            "stage %d: weights by %s (%s) in %.2fs, %.1f MB, from %s; continuing at step %d, lr x%.2f",
            event.stage,
            event.method,
            event.cause,
            event.seconds,
            event.bytes_fetched / 1e6,
            ", ".join(f"stage {s['stage']} {s['node_id'][:12]} (weight {s['weight']:.3f})" for s in event.sources)
            or "no source",
            event.step,
            event.lr_scale,
        )
        append_json_line(self.state_dir / "recoveries.jsonl", event.to_json())

    # moving -------------------------------------------------------------------------------

    def check_move(self) -> Move | None:
        """Rebalancing (selection.plan_move) on the announce loop's last map: the move this server should make now, if
        any."""
        if self.state != "serving" or self._latest_map is None:
            return None
        now = time.time()
        # A server slow to announce must not set replicas moving: a stage is empty when a driver reported it lost, or
        # when its announcements aged out of the TTL (not the newcomers' stricter freshness). The company a mover
        # leaves behind must be fresh, though (plan_move's fresh_s).
        view = live_view(self._latest_map, now, self.pipeline.announce_ttl_s)
        self._empty_since = update_empty_since(self._empty_since, view, now)
        return plan_move(
            view,
            self.announcement(),
            self._empty_since,
            now,
            self.pipeline.rebalance_grace_s,
            self.pipeline.balance_quality,
            fresh_s=fresh_window_s(self.pipeline.announce_interval_s, self.pipeline.announce_ttl_s),
        )

    async def move(self, move: Move) -> RecoveryEvent:
        """Leave the current stage (its other replicas carry it on) and take up `move.stage`."""
        log.warning("moving from stage %d to stage %d: %s", self.index, move.stage, move.cause)
        await self._stop_averaging()
        async with self.handler.torch_lock:  # no call of the old stage is running once we hold it
            self.handler.backend = None
            self.handler.state = "loading"
        self.moves += 1
        self._empty_since, self._latest_map = {}, None
        event = await self.acquire(move.stage, f"moved: {move.cause}")
        await self._start_averaging()
        return event

    async def call_onward(self, hop: RouteHop, call: StageCall) -> StageResult:
        """Send the next hop of a chained call to its server, found by peer id in the signed stage announcements (the
        announce loop's read, or one of our own at most once an announce interval): never an address the caller gave.
        The deadline covers the hops after it. HopFailed as any call, BackendRefused when the server is not found."""
        server = self._announced(self._latest_map, hop) or self._announced(self._onward_map, hop)
        if server is None and time.monotonic() - self._onward_map_read_at >= self.pipeline.announce_interval_s:
            self._onward_map_read_at = time.monotonic()
            self._onward_map = await self.read_map()
            server = self._announced(self._onward_map, hop)
        if server is None:
            raise BackendRefused(
                PipelineRefusal.ONWARD_FAILED,
                f"stage {hop.stage} server {hop.peer_id[:12]} is not among the announcements this server reads",
            )
        timeout = self.pipeline.call_timeout_s * (1 + len(call.route))
        return await until_answered(lambda: call_stage(self.dht.p2p, self.protocol, server, call, self.limits, timeout))

    @staticmethod
    def _announced(stage_map: StageMap | None, hop: RouteHop) -> StageAnnouncement | None:
        servers = stage_map.servers.get(hop.stage, []) if stage_map is not None else []
        return next(
            (s for s in servers if s.p2p_peer_id == hop.peer_id and s.stage_fingerprint == hop.stage_fingerprint), None
        )

    # lifecycle ------------------------------------------------------------------------------

    async def run(self) -> None:
        if not self.session.addresses:  # a session join_swarm did not open has not asked its daemon yet
            await self.session.refresh_addresses()
        await self.dht.p2p.add_binary_stream_handler(self.protocol, self.handler.handle)
        announcing = self._spawn(self._announce_loop(), "stage-announce")
        try:
            index, cause = await self.choose_stage()
            await self.acquire(index, cause)
            await self._start_averaging()
            while not self._stopping.is_set():
                await asyncio.sleep(self.pipeline.announce_interval_s)
                if announcing.done():
                    raise RuntimeError("the stage announcer died") from announcing.exception()
                await self._sync_replica_parts()
                if self.pipeline.rebalance and (move := self.check_move()) is not None:
                    await self.move(move)
                # off the event loop: an fsync waits for the disk, for as long as other writers keep it busy (another
                # process's checkpoints), and pipeline calls and the DHT wait for the loop
                await asyncio.to_thread(atomic_write_text, self.state_dir / "stage.json", json.dumps(self.counters()))
        finally:
            await self.stop()

    async def stop(self) -> None:
        self._stopping.set()
        await cancel_and_wait(self._tasks, "stage server")
        await self._stop_averaging()
        try:
            await asyncio.wait_for(self.dht.p2p.remove_binary_stream_handler(self.protocol), 5)
        except Exception as exc:  # noqa: BLE001 - p2pd may already be gone on shutdown; say so and leave
            log.debug("could not remove the pipeline handler: %s", exc)

    def _spawn(self, coro, name: str) -> asyncio.Task:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def announcement(self) -> StageAnnouncement:
        layers = self.plan.layer_range(self.index) if self.index >= 0 else range(0)
        backend = self.backend
        return StageAnnouncement(
            node_id=self.identity.node_id,
            p2p_peer_id=self.dht.peer_id.to_base58(),
            model_fingerprint=self.model_fingerprint,
            num_stages=self.plan.num_stages,
            stage=self.index,
            stage_fingerprint=self.handler.fingerprint if self.index >= 0 else "",
            layer_start=layers.start,
            layer_end=layers.stop,
            parts=sorted(backend.held_parts()) if backend else [],
            state=self.state,
            step=self.step,
            grad_norm=float(backend.grad_norm) if backend else 0.0,
            samples_per_s=float(backend.samples_per_s) if backend else 0.0,
            recoveries=self.recoveries,
            replicas=self.replicas[:32],
            # where drivers and other servers dial us: the session's addresses now, as its membership refreshes them
            # (a relay slot reserved, or reserved again, after the start)
            p2p_maddrs=self.session.addresses[: DEFAULT_LIMITS.max_addresses],
        )

    async def announce(self) -> None:
        await self.announcer.publish(self.announcement())

    async def _announce_loop(self) -> None:
        while True:
            started = time.monotonic()
            try:
                await self.announce()
                if self.index >= 0 and self.state == "serving":
                    self._latest_map = (
                        stage_map
                    ) = await self.read_map()  # also what check_move judges: one read per beat
                    self.replicas = [
                        s.node_id for s in stage_map.live(self.index) if s.node_id != self.identity.node_id
                    ]
            except Exception as exc:  # noqa: BLE001 - a lost announcement is retried next beat; the loop must not die of it
                log.warning("stage announcement not published: %s", exc)
            # Keep the beat: choosers count a server only while its announcement is a few intervals old at most.
            await asyncio.sleep(max(0.0, self.pipeline.announce_interval_s - (time.monotonic() - started)))

    async def _start_averaging(self) -> None:
        """Replicas of one stage keep close with NoLoCo/DiLoCo averaging, keyed by the stage fingerprint."""
        if self.config.averaging.method == "none":
            return
        from node.averaging.service import start_averaging

        # the replicas of this stage average with each other: the stage's fingerprint keys them
        self.averaging = await start_averaging(
            self.config, self.session, self.backend.stage, self.handler.fingerprint, self.step
        )
        # between steps, when no torch work runs (the handler holds the lock)
        self.handler.before_step = self.averaging.apply_if_done
        self.handler.after_step = self.averaging.maybe_start

    async def _stop_averaging(self) -> None:
        if self.averaging is not None:
            self.handler.before_step, self.handler.after_step = (lambda: None), (lambda step: None)
            await self.averaging.stop()
            self.averaging = None

    async def _sync_replica_parts(self) -> None:
        """CheckFree+: refresh our copy of the neighbouring end stage's embedding or head."""
        backend = self.backend
        if backend is None:
            return
        own = self.plan.parts(self.index)
        replica_parts = [p for p in backend.stage.parts if p not in own]
        if (
            not replica_parts
            or self.step - self._last_replica_sync < self.pipeline.replica_sync_every
            and self._last_replica_sync >= 0
        ):
            return
        # with three stages the middle one holds both copies: each comes from its own owner
        owners = {0 if part is StagePart.EMBED else self.plan.num_stages - 1: part for part in replica_parts}
        stage_map = await self.read_map()
        for owner, part in owners.items():
            source = stage_map.pick(owner, self._rng)
            if source is None:
                return
            try:
                weights, _ = await self.loader.fetch(source, [part.value], backend.stage)
            except HopFailed as exc:
                log.info("CheckFree+ replica refresh from stage %d failed: %s", owner, exc)
                return
            async with self.handler.torch_lock:
                if self.backend is backend:
                    for name, tensors in split_parts(weights).items():
                        await asyncio.to_thread(backend.stage.load_part_state_dict, StagePart(name), tensors)
        self._last_replica_sync = self.step

    # what it shows -------------------------------------------------------------------------

    def counters(self) -> dict:
        """What `stage.json`, `swarm-node stats` and /metrics show of this server."""
        backend = self.backend
        refusals = self.handler.stats.refusals
        return {
            "stage": self.index,
            "state": self.state,
            "step": self.step,
            "grad_norm": backend.grad_norm if backend else 0.0,
            "samples_per_s": backend.samples_per_s if backend else 0.0,
            "recoveries": self.recoveries,
            "moves": self.moves,
            "lr_scale": backend.lr_scale if backend else 1.0,
            "replicas": len(self.replicas),
            "calls": dict(self.handler.calls),
            # op -> where its served calls' seconds went, summed (node/pipeline/handler.py CALL_PHASES)
            "call_seconds": {op: dict(phases) for op, phases in sorted(self.handler.call_seconds.items())},
            "refusals": refusals.by_reason(),
            "refusals_by_peer": refusals.by_peer(),
            "pending_forwards": backend.pending_forwards if backend else 0,
            "sessions": backend.sessions if backend else 0,
            "averaging": self.averaging.counters() if self.averaging else None,
        }

    def prometheus(self) -> str:
        """/metrics: the server's gauges and call counts, and refused calls by peer and reason, with the node's one
        renderer."""
        counters = self.counters()
        gauges = {
            f"pipeline_{name}": float(counters[name])
            for name in (
                "stage",
                "step",
                "grad_norm",
                "samples_per_s",
                "recoveries",
                "moves",
                "lr_scale",
                "replicas",
                "pending_forwards",
                "sessions",
            )
        }
        gauges.update({f"pipeline_calls_{op}": float(n) for op, n in sorted(self.handler.calls.items())})
        gauges.update(
            {
                f"pipeline_call_seconds_{op}_{phase}": float(seconds)
                for op, phases in counters["call_seconds"].items()
                for phase, seconds in phases.items()
            }
        )
        return prometheus_text(gauges, self.handler.stats)
