"""A stage server: one pipeline stage of a model no single node holds, served over p2p streams.

Why it looks like this. SWARM parallelism and Petals serve a model as stages announced in a
DHT; any number of servers may serve one stage, a client routes each micro-batch through
one server per stage and fails over when a hop fails. We do the same on the node's own
DHT and p2p daemon (as the averaging exchange does, `node/averaging/pairing.py`), with
the calls of `protocol/pipeline.py` framed by `node/transport/framing.py`:

    handler  swarm-node/v1/<swarm>/pipeline/<model fingerprint>/v1     (one call per stream)
    key      swarm-node/v1/<swarm>/stages/<model fingerprint>          (signed announcements)

Life of a server (`run`):
1. pick its stage: an index, `auto` (the least-served stage), or `spare` (announce itself
   as a spare and wait until some stage has no live server left);
2. get the stage's weights from live nodes only (`recovery.py`): a replica's copy, else
   CheckFree from the neighbours, CheckFree+ for an end stage, else the initial model
   if the pipeline has not trained yet; announce "loading" meanwhile;
3. serve: forward (keeping the graph for its backward), backward (gradients accumulate),
   step (clip this stage's gradient, AdamW step, remember the norm for CheckFree), infer
   (a per-session KV cache, Petals' inference sessions), weights (for copies/recoveries);
4. keep its CheckFree+ replica (stage 1: the embedding; stage S-2: the head) fresh by
   copying it from its owner every `replica_sync_every` steps, and average its weights with
   other replicas of its stage (NoLoCo/DiLoCo, keyed by the stage fingerprint) when
   averaging is on.

Every call is checked before torch sees it: the message (`protocol.pipeline`), the stage
and its fingerprint, the parts asked for, each tensor's name, dtype, shape and values
(`tensors.py`). A bad call gets a REFUSE frame with a `PipelineRefusal` (or protocol
`Refusal`) code, counted by reason and by peer; it never raises out of the handler.
All torch work of a server runs in one worker thread, one call at a time, so the
asyncio loop keeps answering the DHT and new streams while a step runs.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from pathlib import Path

import msgpack
import torch

from node.aio import cancel_and_wait
from node.averaging.codec import CodecError, EncodedWeights, decode_weights, encode_weights
from node.averaging.validation import WeightsRefused, validate_partner_weights
from node.config import NodeConfig
from node.pipeline.client import CONTROL_MAX_BYTES, HopFailed, call_stage, handler_name, unpack
from node.pipeline.recovery import RecoveryEvent, RecoveryImpossible, checkfree_weights, choose_method
from node.pipeline.stagemap import Announcer, StageMap, read_stage_map
from node.pipeline.stages import PipelineStage, StagePart, StagePlan, checkfree_plus_extra_parts, stage_fingerprint
from node.pipeline.tensors import TensorRefused, expect, to_wire
from node.state import atomic_write_text
from node.transport.framing import FramingError, OversizedFrame, read_frame, write_frame
from protocol import DEFAULT_LIMITS, NodeIdentity, ProtocolRejection, RefusalCounter, StageAnnouncement
from protocol.pipeline import PIPELINE_VERSION, PipelineFrame, PipelineLimits, StageCall, StageResult, refusal_body
from protocol.refusals import PipelineRefusal, Refusal

log = logging.getLogger(__name__)

READ_TIMEOUT_S = 30.0  # a caller that opens a stream must send its call within this


@dataclass
class _Pending:
    """A forward kept for its backward."""

    inputs: torch.Tensor | None  # the input hidden states (requires grad), None when the input was token ids
    output: torch.Tensor
    batch: int
    created: float


class _CallRefused(Exception):
    def __init__(self, reason: Refusal | PipelineRefusal, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


def stage_plan(config: NodeConfig, hf_config) -> StagePlan:
    return StagePlan(num_layers=hf_config.num_hidden_layers, num_stages=config.pipeline.num_stages)


def extra_parts_for(config: NodeConfig, index: int) -> tuple[StagePart, ...]:
    if not config.pipeline.checkfree_plus or config.pipeline.num_stages < 2:
        return ()
    return checkfree_plus_extra_parts(config.pipeline.num_stages).get(index, ())


def expected_fingerprints(config: NodeConfig, hf_config, model_fingerprint: str) -> list[str]:
    """Every stage's fingerprint, computed from the model's config alone (what drivers check servers against)."""
    plan = stage_plan(config, hf_config)
    return [stage_fingerprint(model_fingerprint, plan, i, PipelineStage.from_config(hf_config, plan, i, extra_parts_for(config, i))) for i in range(plan.num_stages)]


def pipeline_limits(config: NodeConfig, hf_config, model_parameters: int) -> PipelineLimits:
    """What one call may carry for this model: a batch of the largest sequences, as hidden states or logits."""
    max_len = config.pipeline.max_sequence_length or hf_config.max_position_embeddings
    widest = max(hf_config.hidden_size, hf_config.vocab_size)
    return PipelineLimits(max_tensors=4, max_rank=3, max_dim=max(config.pipeline.max_batch_size, max_len, widest),
                          max_elements=config.pipeline.max_batch_size * max_len * widest, max_weights_bytes=8 * model_parameters + (1 << 20))


def part_tensors(stage: PipelineStage, parts: list[str]) -> dict[str, torch.Tensor]:
    """The named tensors of `parts`, as they travel in a `weights` result: "<part>/<name>"."""
    return {f"{part}/{name}": tensor for part in parts for name, tensor in stage.part_state_dict(StagePart(part)).items()}


def split_parts(named: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in named.items():
        part, _, name = key.partition("/")
        out.setdefault(part, {})[name] = tensor
    return out


class StageServer:
    def __init__(self, config: NodeConfig, identity: NodeIdentity, dht, initial_model, model_fingerprint: str, state_dir: Path) -> None:
        self.config = config
        self.pipeline = config.pipeline
        self.identity = identity
        self.dht = dht
        self.initial_model = initial_model  # the initial policy: weights for a pipeline that has not trained yet, and the architecture
        self.hf_config = initial_model.config
        self.model_fingerprint = model_fingerprint
        self.state_dir = state_dir
        self.plan = stage_plan(config, self.hf_config)
        self.handler = handler_name(config.swarm.swarm_id, model_fingerprint)
        self.max_len = self.pipeline.max_sequence_length or self.hf_config.max_position_embeddings
        self.limits = pipeline_limits(config, self.hf_config, sum(p.numel() for p in initial_model.parameters()))
        self.announcer = Announcer(dht, config, identity)
        self.p2p_maddrs: list[str] = []  # where drivers and other servers dial us (set when run() starts)
        self.index: int = -1
        self.state = "spare"
        self.stage: PipelineStage | None = None
        self.fingerprint = ""
        self.optimizer: torch.optim.Optimizer | None = None
        self.step = 0
        self.grad_norm = 0.0
        self.lr_scale = 1.0
        self.samples_per_s = 0.0
        self.recoveries = 0
        self.replicas: list[str] = []
        self.refusals = RefusalCounter(max_peers=256)
        self.calls: Counter[str] = Counter()
        self._last_refusal_log: dict[tuple[str, str], float] = {}
        self._pending: OrderedDict[tuple[str, str], _Pending] = OrderedDict()
        self._sessions: OrderedDict[tuple[str, str], tuple[object, float]] = OrderedDict()
        self._torch_lock = asyncio.Lock()
        self._tasks: set[asyncio.Task] = set()
        self._stopping = asyncio.Event()
        self._last_replica_sync = -1
        self._rng = random.Random(identity.node_id)
        self.averaging = None

    # choosing and loading a stage -------------------------------------------------------

    async def read_map(self) -> StageMap:
        return await read_stage_map(self.dht, self.config, self.model_fingerprint)

    async def choose_stage(self) -> tuple[int, str]:
        """(stage index, cause). A spare announces itself and waits for a stage with no live server."""
        wanted = self.pipeline.stage
        if isinstance(wanted, int):
            if not 0 <= wanted < self.plan.num_stages:
                raise ValueError(f"pipeline.stage {wanted} is outside [0, {self.plan.num_stages})")
            return wanted, "configured"
        stage_map = await self.read_map()
        if wanted == "auto":
            return stage_map.least_served(), "auto: least served"
        log.info("spare: waiting for a stage whose last server dies")
        while not self._stopping.is_set():
            await self.announce()
            stage_map = await self.read_map()
            empty = stage_map.empty_stages() if stage_map.servers else []
            empty = [i for i in empty if not stage_map.loading.get(i)]
            # Spares that see the same holes agree without talking: the k-th spare by node id takes the k-th hole.
            rank = sorted({s.node_id for s in stage_map.spares} | {self.identity.node_id}).index(self.identity.node_id)
            if rank < len(empty):
                return empty[rank], "no live server"
            await asyncio.sleep(self.pipeline.announce_interval_s / 2)
        raise asyncio.CancelledError

    async def acquire(self, index: int, cause: str) -> RecoveryEvent:
        """Load stage `index`'s weights from the live swarm (see recovery.py); never from disk."""
        started = time.perf_counter()
        self.index = index
        self.state = "loading"
        extra = extra_parts_for(self.config, index)
        stage = PipelineStage.from_model(self.initial_model, self.plan, index, extra_parts=extra)
        self.stage, self.fingerprint = stage, stage_fingerprint(self.model_fingerprint, self.plan, index, stage)
        await self.announce()
        while True:
            stage_map = await self.read_map()
            replicas = [s for s in stage_map.live(index) if s.node_id != self.identity.node_id and s.stage_fingerprint == self.fingerprint]
            try:
                method, sources = choose_method(index, self.plan.num_stages, bool(replicas), stage_map.trained(), self.pipeline.recovery, self.pipeline.checkfree_plus)
            except RecoveryImpossible as exc:
                log.error("stage %d cannot be rebuilt yet: %s; waiting", index, exc)
                await asyncio.sleep(self.pipeline.announce_interval_s)
                continue
            try:
                event = await self._load(stage, method, sources, replicas, stage_map)
            except HopFailed as exc:
                log.warning("stage %d: %s from %s failed (%s); trying again", index, method, exc.server.node_id[:12], exc)
                await asyncio.sleep(self.pipeline.announce_interval_s / 2)
                continue
            except _MissingSource as exc:
                log.warning("stage %d: %s; waiting for it", index, exc)
                await asyncio.sleep(self.pipeline.announce_interval_s / 2)
                continue
            break
        event.cause = cause
        event.seconds = time.perf_counter() - started
        self.lr_scale = event.lr_scale
        self.step = event.step
        self.optimizer = self._new_optimizer()
        if method != "initial":
            self.recoveries += 1
        self.state = "serving"
        self._log_event(event)
        await self.announce()
        return event

    async def _load(self, stage: PipelineStage, method: str, sources: list[int], replicas: list[StageAnnouncement], stage_map: StageMap) -> RecoveryEvent:
        event = RecoveryEvent(stage=self.index, method=method, cause="")
        if method == "initial":
            return event
        if method == "random":
            fresh = PipelineStage.from_config(self.hf_config, self.plan, self.index, extra_parts_for(self.config, self.index))
            for part in stage.parts:
                stage.load_part_state_dict(part, fresh.part_state_dict(part))
            event.step = max((s.step for group in stage_map.servers.values() for s in group), default=0)
            return event
        if method == "replica_copy":
            source = self._rng.choice(replicas)
            weights, result = await self._fetch(source, [p.value for p in stage.parts])
            for part, tensors in split_parts(weights).items():
                stage.load_part_state_dict(StagePart(part), tensors)
            event.sources = [{"stage": self.index, "node_id": source.node_id, "step": result.step, "grad_norm": result.grad_norm, "weight": 1.0}]
            event.step, event.lr_scale = result.step, result.lr_scale
            return event
        fetched = {}
        for neighbour in sources:
            candidates = stage_map.live(neighbour)
            if not candidates:
                raise _MissingSource(f"no live server of neighbour stage {neighbour}")
            source = self._rng.choice(candidates)
            wanted = ["layers"] + [p for p in ("embed", "head") if p in source.parts and StagePart(p) in stage.parts and method == "checkfree_plus"]
            fetched[neighbour] = (source, *await self._fetch(source, wanted))
        if method == "checkfree":
            (prev_src, prev_w, prev_r), (next_src, next_w, next_r) = fetched[sources[0]], fetched[sources[1]]
            merged, a, b = checkfree_weights(split_parts(prev_w)["layers"], split_parts(next_w)["layers"], prev_r.grad_norm, next_r.grad_norm)
            stage.load_part_state_dict(StagePart.LAYERS, merged)
            event.sources = [
                {"stage": sources[0], "node_id": prev_src.node_id, "step": prev_r.step, "grad_norm": prev_r.grad_norm, "weight": b / (a + b)},
                {"stage": sources[1], "node_id": next_src.node_id, "step": next_r.step, "grad_norm": next_r.grad_norm, "weight": a / (a + b)},
            ]
            event.step = max(prev_r.step, next_r.step)
        else:  # checkfree_plus: the neighbour's layers stood in for ours on odd micro-batches; it holds our (de)embedding copy
            source, weights, result = fetched[sources[0]]
            parts = split_parts(weights)
            for part, tensors in parts.items():
                stage.load_part_state_dict(StagePart(part), tensors)
            missing = [p.value for p in stage.parts if p is not StagePart.LAYERS and p.value not in parts and p in (StagePart.EMBED, StagePart.HEAD) and self._owns(p)]
            if missing:
                raise _MissingSource(f"neighbour stage {sources[0]} holds no copy of {missing}")
            event.sources = [{"stage": sources[0], "node_id": source.node_id, "step": result.step, "grad_norm": result.grad_norm, "weight": 1.0}]
            event.step = result.step
        event.lr_scale = self.pipeline.recovered_lr_scale
        return event

    def _owns(self, part: StagePart) -> bool:
        """Is `part` this stage's own (not a CheckFree+ replica of a neighbour's)?"""
        return part in self.plan.parts(self.index)

    async def _fetch(self, source: StageAnnouncement, parts: list[str]) -> tuple[dict[str, torch.Tensor], StageResult]:
        call = StageCall(v=PIPELINE_VERSION, op="weights", stage=source.stage, stage_fingerprint=source.stage_fingerprint, call_id=f"weights-{time.time_ns()}",
                         parts=parts, train=False, tensors={}, scale=1.0)
        result = await call_stage(self.dht.p2p, self.handler, source, call, self.limits, self.pipeline.call_timeout_s * 3)
        if result.weights is None:
            raise HopFailed(source, "malformed", "a weights result without weights")
        try:
            encoded = EncodedWeights.from_bytes(result.weights, max_tensors=4096, max_values=self.limits.max_weights_bytes // 4)
            weights = decode_weights(encoded, dtype=None)
        except CodecError as exc:
            raise HopFailed(source, "malformed", str(exc)) from None
        local = part_tensors(self.stage, parts)  # we only ever fetch parts we hold: their names and shapes are ours
        try:
            validate_partner_weights(local, weights, math.inf)  # names, shapes, dtypes, finite
        except WeightsRefused as exc:
            raise HopFailed(source, "refused_weights", str(exc)) from None
        return weights, result

    def _new_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.stage.parameters(), lr=self.pipeline.lr * self.lr_scale, weight_decay=self.pipeline.weight_decay)

    def _log_event(self, event: RecoveryEvent) -> None:
        record = event.to_json()
        log.info("stage %d: weights by %s (%s) in %.2fs from %s; continuing at step %d, lr x%.2f", event.stage, event.method, event.cause, event.seconds,
                 ", ".join(f"stage {s['stage']} {s['node_id'][:12]} (weight {s['weight']:.3f})" for s in event.sources) or "no source", event.step, event.lr_scale)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        with open(self.state_dir / "recoveries.jsonl", "a") as handle:
            handle.write(json.dumps(record) + "\n")

    # lifecycle ------------------------------------------------------------------------------

    async def run(self) -> None:
        self.p2p_maddrs = [str(a) for a in await self.dht.get_visible_maddrs()][:DEFAULT_LIMITS.max_addresses]
        await self.dht.p2p.add_binary_stream_handler(self.handler, self._handle)
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
                atomic_write_text(self.state_dir / "stage.json", json.dumps(self.counters()))
        finally:
            await self.stop()

    async def stop(self) -> None:
        self._stopping.set()
        await cancel_and_wait(self._tasks, "stage server")
        if self.averaging is not None:
            await self.averaging.stop()
            self.averaging = None
        try:
            await asyncio.wait_for(self.dht.p2p.remove_binary_stream_handler(self.handler), 5)
        except Exception as exc:  # noqa: BLE001 - p2pd may already be gone on shutdown; say so and leave
            log.debug("could not remove the pipeline handler: %s", exc)

    def _spawn(self, coro, name: str) -> asyncio.Task:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def announcement(self) -> StageAnnouncement:
        layers = self.plan.layer_range(self.index) if self.index >= 0 else range(0)
        return StageAnnouncement(
            node_id=self.identity.node_id, p2p_peer_id=self.dht.peer_id.to_base58(), model_fingerprint=self.model_fingerprint,
            num_stages=self.plan.num_stages, stage=self.index, stage_fingerprint=self.fingerprint if self.index >= 0 else "",
            layer_start=layers.start, layer_end=layers.stop, parts=[p.value for p in self.stage.parts] if self.stage else [],
            state=self.state, step=self.step, grad_norm=float(self.grad_norm), samples_per_s=float(self.samples_per_s),
            recoveries=self.recoveries, replicas=self.replicas[:32], p2p_maddrs=self.p2p_maddrs,
        )

    async def announce(self) -> None:
        await self.announcer.publish(self.announcement())

    async def _announce_loop(self) -> None:
        while True:
            try:
                await self.announce()
                if self.index >= 0 and self.state == "serving":
                    stage_map = await self.read_map()
                    self.replicas = [s.node_id for s in stage_map.live(self.index) if s.node_id != self.identity.node_id]
            except Exception as exc:  # noqa: BLE001 - a lost announcement is retried next beat; the loop must not die of it
                log.warning("stage announcement not published: %s", exc)
            await asyncio.sleep(self.pipeline.announce_interval_s)

    async def _start_averaging(self) -> None:
        """Replicas of one stage keep close with NoLoCo/DiLoCo averaging, keyed by the stage fingerprint."""
        if self.config.averaging.method == "none":
            return
        from node.averaging.fingerprint import averaging_prefix
        from node.averaging.pairing import PairAverager
        from node.averaging.service import OuterStepService
        from node.transport.records import RecordWriter

        averaging = self.config.averaging
        averager = PairAverager(self.dht, averaging_prefix(self.config.swarm.swarm_id, self.fingerprint), group_size=2 if averaging.method == "noloco" else None,
                                mode=averaging.transfer_dtype, max_relative_distance=averaging.max_relative_distance,
                                writer=RecordWriter(self.identity, self.config.swarm.swarm_id))
        await averager.start()
        self.averaging = OuterStepService(self.config, self.stage, averager)
        self.averaging.last_trigger_version = self.step

    async def _sync_replica_parts(self) -> None:
        """CheckFree+: refresh our copy of the neighbouring end stage's embedding or head."""
        replica_parts = [p for p in self.stage.parts if not self._owns(p)]
        if not replica_parts or self.step - self._last_replica_sync < self.pipeline.replica_sync_every and self._last_replica_sync >= 0:
            return
        owner = 0 if StagePart.EMBED in replica_parts else self.plan.num_stages - 1
        stage_map = await self.read_map()
        source = stage_map.pick(owner, self._rng)
        if source is None:
            return
        try:
            weights, _ = await self._fetch(source, [p.value for p in replica_parts])
        except HopFailed as exc:
            log.info("CheckFree+ replica refresh from stage %d failed: %s", owner, exc)
            return
        async with self._torch_lock:
            for part, tensors in split_parts(weights).items():
                await asyncio.to_thread(self.stage.load_part_state_dict, StagePart(part), tensors)
        self._last_replica_sync = self.step

    # serving calls ------------------------------------------------------------------------------

    async def _handle(self, stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = stream_info.peer_id.to_base58()
        try:
            try:
                kind, body = await asyncio.wait_for(read_frame(reader, PipelineFrame, lambda k: self.limits.frame_limit() if k is PipelineFrame.CALL else CONTROL_MAX_BYTES), READ_TIMEOUT_S)
                if kind is not PipelineFrame.CALL:
                    raise _CallRefused(Refusal.BAD_STRUCTURE, f"expected CALL, got {kind.name}")
                try:
                    call = StageCall.from_wire(unpack(body, self.limits), self.limits)
                except ValueError as exc:  # msgpack's errors are ValueErrors
                    raise _CallRefused(Refusal.NOT_MSGPACK, str(exc)) from None
                except ProtocolRejection as exc:
                    raise _CallRefused(exc.reason, exc.detail) from None
                result = await self._serve(peer, call)
            except OversizedFrame as exc:
                raise _CallRefused(Refusal.TOO_LARGE, str(exc)) from None
            except FramingError as exc:
                raise _CallRefused(Refusal.BAD_STRUCTURE, str(exc)) from None
            self.calls[call.op] += 1
            await write_frame(writer, PipelineFrame.RESULT, msgpack.packb(result.to_wire(), use_bin_type=True))
        except _CallRefused as refused:
            self.refusals.record(peer, refused.reason)
            self._log_refusal(peer, refused)
            try:
                await write_frame(writer, PipelineFrame.REFUSE, msgpack.packb(refusal_body(refused.reason, refused.detail)))
            except (ConnectionError, OSError):
                pass
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError, OSError) as exc:
            self.calls["broken_stream"] += 1
            log.debug("pipeline call from %s broke: %s", peer[:12], exc)
        finally:
            writer.close()

    async def _serve(self, peer: str, call: StageCall) -> StageResult:
        if self.stage is None or call.stage != self.index or call.stage_fingerprint != self.fingerprint:
            raise _CallRefused(PipelineRefusal.WRONG_STAGE, f"this server serves stage {self.index} ({self.fingerprint or 'none yet'})")
        if self.state != "serving" and call.op != "weights":
            raise _CallRefused(PipelineRefusal.NOT_READY, f"state {self.state}")
        # Calls run the parts this stage owns; its CheckFree+ copies of a neighbour's part are only read (by `weights`).
        held = {p.value for p in self.stage.parts} if call.op == "weights" else {p.value for p in self.plan.parts(self.index)}
        missing = [p for p in call.parts if p not in held]
        if missing:
            raise _CallRefused(PipelineRefusal.MISSING_PART, f"this server holds {sorted(held)}, not {missing}")
        self._expire()
        async with self._torch_lock:
            try:
                if call.op == "forward":
                    tensors = await asyncio.to_thread(self._forward, peer, call)
                elif call.op == "backward":
                    tensors = await asyncio.to_thread(self._backward, peer, call)
                elif call.op == "step":
                    tensors = await self._step(call)
                elif call.op == "infer":
                    tensors = await asyncio.to_thread(self._infer, peer, call)
                elif call.op == "end_session":
                    self._sessions.pop((peer, call.call_id), None)
                    tensors = {}
                else:  # weights
                    payload = await asyncio.to_thread(lambda: encode_weights(part_tensors(self.stage, call.parts or [p.value for p in self.stage.parts]), "fp32").to_bytes())
                    return self._result({}, weights=payload)
            except TensorRefused as exc:
                raise _CallRefused(exc.reason, exc.detail) from None
            except _CallRefused:
                raise
            except Exception as exc:  # noqa: BLE001 - a compute error is refused to the caller, logged here, and the server lives on
                log.exception("stage %d: %s call failed", self.index, call.op)
                raise _CallRefused(PipelineRefusal.FAILED, f"{type(exc).__name__}: {exc}") from None
        return self._result(tensors)

    def _result(self, tensors: dict[str, torch.Tensor], weights: bytes | None = None) -> StageResult:
        return StageResult(v=PIPELINE_VERSION, tensors={k: to_wire(t) for k, t in tensors.items()}, weights=weights, step=self.step,
                           grad_norm=float(self.grad_norm), lr_scale=float(self.lr_scale))

    def _expire(self) -> None:
        deadline = time.monotonic() - self.pipeline.pending_ttl_s
        while self._pending and next(iter(self._pending.values())).created < deadline:
            self._pending.popitem(last=False)
        while self._sessions and next(iter(self._sessions.values()))[1] < deadline:
            self._sessions.popitem(last=False)

    def _inputs(self, call: StageCall, first_part: str, cached_len: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(input ids or hidden states, position ids, attention mask), each checked against this model."""
        tensors = call.tensors
        hidden_dtype = next(self.stage.parameters()).dtype
        if first_part == "embed":
            x = expect(tensors, "input_ids", torch.int64, (None, None))
            if x.numel() and (int(x.min()) < 0 or int(x.max()) >= self.hf_config.vocab_size):
                raise TensorRefused(f"input_ids outside [0, {self.hf_config.vocab_size})")
        elif first_part in ("layers", "head"):
            x = expect(tensors, "hidden", hidden_dtype, (None, None, self.hf_config.hidden_size))
        else:
            raise TensorRefused("a call needs at least one part")
        batch, length = x.shape[0], x.shape[1]
        if not 0 < batch <= self.pipeline.max_batch_size or not 0 < length or cached_len + length > self.max_len:
            raise TensorRefused(f"batch {batch} x {cached_len}+{length} tokens is outside this server's limits ({self.pipeline.max_batch_size} x {self.max_len})")
        positions = expect(tensors, "position_ids", torch.int64, (batch, length))
        if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= self.max_len):
            raise TensorRefused("position_ids out of range")
        mask = expect(tensors, "attention_mask", torch.int64, (batch, cached_len + length))
        return x, positions, mask

    def _run_parts(self, parts: list[str], x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache=None) -> torch.Tensor:
        for part in parts:
            if part == "embed":
                x = self.stage.embed(x)
            elif part == "layers":
                x = self.stage.forward_layers(x, positions, mask, cache=cache)
            else:
                x = self.stage.head(x)
        return x

    def _forward(self, peer: str, call: StageCall) -> dict[str, torch.Tensor]:
        if not call.parts:
            raise TensorRefused("a forward needs at least one part")
        x, positions, mask = self._inputs(call, call.parts[0])
        if not call.train:
            with torch.no_grad():
                return {"output": self._run_parts(call.parts, x, positions, mask)}
        if len(self._pending) >= self.pipeline.max_pending_forwards:
            raise _CallRefused(PipelineRefusal.BUSY, f"{len(self._pending)} forwards await their backward")
        started = time.perf_counter()
        inputs = None
        if call.parts[0] != "embed":
            inputs = x.requires_grad_(True)
        self.stage.train()
        output = self._run_parts(call.parts, x, positions, mask)
        self._pending[(peer, call.call_id)] = _Pending(inputs=inputs, output=output, batch=x.shape[0], created=time.monotonic())
        self._note_throughput(x.shape[0], time.perf_counter() - started)
        return {"output": output.detach()}

    def _backward(self, peer: str, call: StageCall) -> dict[str, torch.Tensor]:
        pending = self._pending.pop((peer, call.call_id), None)
        if pending is None:
            raise _CallRefused(PipelineRefusal.UNKNOWN_CALL, f"no forward {call.call_id!r} from this caller")
        grad = expect(call.tensors, "grad", pending.output.dtype, tuple(pending.output.shape))
        started = time.perf_counter()
        pending.output.backward(grad)
        self._note_throughput(0, time.perf_counter() - started)
        return {} if pending.inputs is None else {"grad": pending.inputs.grad}

    async def _step(self, call: StageCall) -> dict[str, torch.Tensor]:
        if self.averaging is not None:
            self.averaging.apply_if_done()  # between steps, when no torch work runs (we hold the lock)
        stepped = await asyncio.to_thread(self._apply_step, call.scale, call.lr_scale)
        if stepped and self.averaging is not None:
            self.averaging.maybe_start(self.step)
        return {}

    def _apply_step(self, scale: float, lr_scale: float) -> bool:
        params = [p for p in self.stage.parameters() if p.grad is not None]
        if scale == 0.0 or not params:  # scale 0: the driver abandoned this step; drop what accumulated
            self.optimizer.zero_grad(set_to_none=True)
            return False
        for p in params:
            p.grad.mul_(scale)
        norm = torch.nn.utils.clip_grad_norm_(params, self.pipeline.max_grad_norm)
        if not torch.isfinite(norm):
            self.optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(f"non-finite gradient norm at step {self.step}; step refused")
        for group in self.optimizer.param_groups:
            group["lr"] = self.pipeline.lr * self.lr_scale * lr_scale
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.grad_norm = min(float(norm), self.pipeline.max_grad_norm)
        self.step += 1
        return True

    def _infer(self, peer: str, call: StageCall) -> dict[str, torch.Tensor]:
        key = (peer, call.call_id)
        cache = self._sessions.pop(key, (None, 0.0))[0]
        if cache is None:
            if len(self._sessions) >= self.pipeline.max_sessions:
                raise _CallRefused(PipelineRefusal.BUSY, f"{len(self._sessions)} inference sessions open")
            cache = self.stage.new_cache()
        x, positions, mask = self._inputs(call, call.parts[0] if call.parts else "", cached_len=cache.seq_len)
        self.stage.eval()
        with torch.no_grad():
            output = self._run_parts(call.parts, x, positions, mask, cache=cache)
        self._sessions[key] = (cache, time.monotonic())
        return {"output": output}

    def _log_refusal(self, peer: str, refused: _CallRefused) -> None:
        """At most one log line per peer and reason a minute: a flood of bad calls must not flood the log."""
        key = (peer, refused.reason.value)
        now = time.monotonic()
        if now - self._last_refusal_log.get(key, -math.inf) >= 60:
            self._last_refusal_log[key] = now
            while len(self._last_refusal_log) > 1024:
                self._last_refusal_log.pop(next(iter(self._last_refusal_log)))
            log.info("refused a pipeline call from %s: %s: %s", peer[:12], refused.reason.value, refused.detail)

    def _note_throughput(self, sequences: int, seconds: float) -> None:
        if sequences:
            rate = sequences / max(seconds, 1e-6)
            self.samples_per_s = rate if self.samples_per_s == 0 else 0.9 * self.samples_per_s + 0.1 * rate

    def counters(self) -> dict:
        """What `stage.json`, `swarm-node stats` and /metrics show of this server."""
        return {"stage": self.index, "state": self.state, "step": self.step, "grad_norm": self.grad_norm, "samples_per_s": self.samples_per_s,
                "recoveries": self.recoveries, "lr_scale": self.lr_scale, "replicas": len(self.replicas), "calls": dict(self.calls),
                "refusals": self.refusals.by_reason(), "refusals_by_peer": self.refusals.by_peer(), "pending_forwards": len(self._pending),
                "sessions": len(self._sessions), "averaging": self.averaging.counters() if self.averaging else None}

    def prometheus(self) -> str:
        lines = []
        for name in ("stage", "step", "grad_norm", "samples_per_s", "recoveries", "lr_scale", "replicas", "pending_forwards", "sessions"):
            value = self.counters()[name]
            lines += [f"# TYPE swarm_node_pipeline_{name} gauge", f"swarm_node_pipeline_{name} {float(value)}"]
        lines.append("# TYPE swarm_node_pipeline_calls_total counter")
        lines += [f'swarm_node_pipeline_calls_total{{op="{op}"}} {n}' for op, n in sorted(self.calls.items())]
        lines.append("# TYPE swarm_node_pipeline_refused_total counter")
        for peer, counts in self.refusals.by_peer().items():
            lines += [f'swarm_node_pipeline_refused_total{{peer="{peer}",reason="{reason}"}} {n}' for reason, n in sorted(counts.items())]
        return "\n".join(lines) + "\n"


class _MissingSource(RuntimeError):
    """A recovery source is not live (yet)."""


