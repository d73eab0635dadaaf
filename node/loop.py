"""The node: one round loop shared by isolated training and swarm training.

One round = draw I local questions -> sample G completions each -> score locally ->
publish own groups -> collect J external groups and re-score them locally -> GRPO update
-> record metrics (and the round's work, node/compute.py) -> checkpoint. With swarm.local_draw
'balance' the J external groups are collected first and the I local questions fill the specialties
they left short. Torch work runs in a worker thread so the asyncio loop (and the transport services
beside it) keep running while the policy generates or trains.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from node.aio import StopRequested, cancel_and_wait
from node.config import ConfigError, NodeConfig, dump_config
from node.device import describe_device, model_device
from node.files import atomic_write_text
from node.host_memory import MemoryBudget, hand_back_freed_memory
from node.policy import LoadedPolicy, policy_for
from node.rollouts import build_rollout_backend
from node.rollouts.base import ExternalGroup, RolloutBackend
from node.rollouts.partial import PartialRollouts, SampledCompletions
from node.state import CheckpointNotSaved, StateStore, restore_rng
from node.evaluation import HeldoutEvaluator
from node.local_rollouts import LocalRollouts
from node.stats import HTTP_FILE, MetricsServer, RoundProgress, SwarmStats, listening_socket
from node.sharing import OwnAnswerReplay, PeerChoice, PeerRollouts, RoundPlan
from node.tasks import TaskSource
from node.telemetry import Telemetry
from node.transport import Transport, build_transport, needs_session
from node.transport.null import NullTransport
from protocol import NodeIdentity, PeerStats, Refusal

RolloutBackendFactory = Callable[[Any, Any, int], RolloutBackend]


def same_model_source(a: str, b: str) -> bool:
    """Whether two `model.name_or_path` values name the same model (two spellings of one path do)."""
    if a == b:
        return True
    first, second = Path(a).expanduser(), Path(b).expanduser()
    return first.exists() and second.exists() and first.resolve() == second.resolve()


log = logging.getLogger(__name__)

WATCH_INTERVAL_S = 1.0  # how often the watchdog looks at the round in flight


def thread_stacks() -> str:
    """Where every thread of the process is, as tracebacks: a stalled round's log line says what it waits on."""
    import sys
    import threading
    import traceback

    frames = sys._current_frames()
    parts = []
    for thread in threading.enumerate():
        frame = frames.get(thread.ident)
        if frame is not None:
            parts.append(f"thread {thread.name}:\n" + "".join(traceback.format_stack(frame)))
    return "\n".join(parts)


async def _best_effort(closing, what: str, timeout_s: float = 30.0) -> None:
    """Close what is left of a broken connection: whatever it raises or however long it hangs, the node goes on."""
    try:
        await asyncio.wait_for(closing, timeout_s)
    except Exception as exc:  # noqa: BLE001 - it is broken already; say so and move on
        log.info("closing the broken %s: %s: %s", what, type(exc).__name__, exc)


def own_staleness(groups, policy_version: int) -> dict[str, float]:
    """Policy versions the node's own completions were behind the policy they trained (rollout.max_staleness)."""
    behind = [policy_version - c.policy_version for g in groups for c in g.completions]
    return {"staleness_mean": sum(behind) / max(1, len(behind)), "staleness_max": max(behind, default=0)}


class Node:
    def __init__(
        self,
        config: NodeConfig,
        transport: Transport | None = None,
        rollout_backend: RolloutBackendFactory | None = None,
        on_addresses: Callable[[list[str]], None] | None = None,
    ):
        self.config = config
        # (model, tokenizer, policy version) -> backend; None: the one config.rollout.backend names. Tests script
        # rollouts here.
        self.build_backend = rollout_backend or (
            lambda model, tokenizer, version: build_rollout_backend(config, model, tokenizer, version)
        )
        self.store = StateStore(config.resolved_state_dir())
        # built from swarm.transport when not given: in load(), or once the swarm session is open for one that needs it
        self.transport = transport
        self.session = (
            None  # node.transport.session.SwarmSession: this node's one connection to the swarm (swarm.transport=dht)
        )
        self.on_addresses = on_addresses  # told where peers reach this node, at join and whenever it changes
        self.identity = None
        self.stream_seed = config.seed
        if config.swarm.transport != "none":
            self.identity = NodeIdentity.load_or_create(self.store.root / "identity.key")
            # Peers sharing a config must not draw the same questions and samples.
            self.stream_seed = int(
                hashlib.sha256(f"{config.seed}:{self.identity.node_id}".encode()).hexdigest()[:15], 16
            )
        self.tasks = TaskSource(config.tasks, seed=self.stream_seed)
        self.stats = SwarmStats(self.identity.node_id if self.identity is not None else None)
        # swarm.rss_budget_mb: past it the buffers peers fill are dropped; the transport is looked up at each check, as
        # a rejoin replaces it
        budget_mb = config.swarm.rss_budget_mb
        self.memory_budget = (
            MemoryBudget(
                budget_mb << 20, {"peers' buffers": lambda: self.transport.shed_buffers() if self.transport else 0}
            )
            if budget_mb is not None
            else None
        )
        self.round = 0  # rounds completed
        self.policy = policy_for(config, self.store)  # where the weights live: here, or in pipeline stages peers serve
        self.loaded: LoadedPolicy | None = None
        self.model = self.tokenizer = self.trainer = self.backend = None
        self.local: LocalRollouts | None = None  # its own rollouts: generated, scored, chosen (built with the backend)
        self.sharing: PeerRollouts | None = (
            None  # peers' rollouts: checked, chosen, re-scored (built with the tokenizer)
        )
        self.evaluator: HeldoutEvaluator | None = None  # built with the backend
        self.plan = RoundPlan.of(config.swarm)  # what each round does with its own groups and peers'
        # swarm.own_replay: earlier right answers of its own, replayed as demonstrations (saved with each checkpoint)
        self.own_replay = (
            OwnAnswerReplay(self.plan.replayed, seed=self.stream_seed ^ 0x4E91A7) if self.plan.replayed else None
        )
        self.telemetry = Telemetry(config, self.stats)
        self.fingerprint = ""
        self.model_parameters = 0
        self._metrics_server: MetricsServer | None = None
        self.progress = RoundProgress(config.swarm.stall_factor, config.swarm.stall_min_s)  # what /readyz reports
        self._dashboard = None  # node.dashboard.DashboardServer when swarm.dashboard_port is set
        self._listening: dict[str, Any] | None = None  # setting -> its socket, bound by bind_service_ports
        # OuterStepService: started with the transport when averaging.method != none, unless one is given before
        self.averaging = None
        self.swarm_lost: str | None = None  # why its swarm connection is down while it rejoins (None: joined)
        self._rejoining: asyncio.Task | None = None
        self._watchdog: asyncio.Task | None = None
        # set by the watchdog: the session whose daemon stopped answering, and how it was found so
        self._daemon_silent: tuple[object, str] | None = None
        self.sampler_model = None  # the policy the rollout backend samples from: the trainer's, or a copy of it
        self._ahead: asyncio.Task | None = None  # the next round's own rollouts, generating (rollout.max_staleness 1)
        # when the last of them finished (perf_counter): the sampler has been idle since
        self._ahead_done_at: float | None = None
        self.partial: PartialRollouts | None = (
            None  # rollout.over_sample: the groups it stopped, carried (built with the backend)
        )
        self._outer_state: dict | None = None  # restored from a checkpoint, applied when averaging starts

    # set-up ------------------------------------------------------------------

    def load(self, fresh: bool = False, progress: bool | None = None) -> None:
        """Resume from the state dir when it holds a checkpoint, else start from the initial policy."""
        hand_back_freed_memory()  # before the model loads: a node that trains for days must not grow with its heap
        if self.config.torch_threads:
            torch.set_num_threads(self.config.torch_threads)
        if fresh:
            self.store.wipe()
        else:
            self._refuse_another_model()
        self.loaded = loaded = self.policy.load(progress)
        self.model, self.tokenizer, self.trainer = loaded.model, loaded.tokenizer, loaded.trainer
        self.tasks = self.tasks.for_tokenizer(self.tokenizer)  # a chat template's prompts, where the model has one
        self.fingerprint, self.model_parameters, self.round = loaded.fingerprint, loaded.parameters, loaded.round
        self._outer_state = loaded.outer_state
        self.telemetry.device = describe_device(model_device(self.model))
        self._build_rollouts(self.trainer.policy_version)
        if loaded.rng is not None:
            restore_rng(loaded.rng)
        if self.own_replay is not None and loaded.node_state and loaded.node_state.get("own_replay"):
            self.own_replay.load_state_dict(loaded.node_state["own_replay"])
        self.store.truncate_metrics(self.round)
        self.store.root.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.store.root / "config.yaml", dump_config(self.config))
        if self.transport is None and not needs_session(self.config):
            self.transport = self._build_transport()

    def bind_service_ports(self) -> None:
        """Listen now on the ports of /metrics and the dashboard (swarm.metrics_port, swarm.dashboard_port; the
        servers start with the swarm services): one another program holds is refused in one line naming it
        (ConfigError), before the node loads its policy or joins anybody, rather than a traceback once it has joined.
        A volunteer who asked for a dashboard wants to see it, not a node that runs on without it."""
        if self._listening is not None:
            return
        swarm = self.config.swarm
        wanted = {
            "swarm.metrics_port": (swarm.metrics_host, swarm.metrics_port),
            "swarm.dashboard_port": (swarm.dashboard_host, swarm.dashboard_port),
        }
        self._listening = {}
        try:
            for setting, (host, port) in wanted.items():
                if port is not None:
                    self._listening[setting] = listening_socket(host, port, setting)
        except ConfigError:
            for sock in self._listening.values():
                sock.close()
            self._listening = None
            raise

    def _refuse_another_model(self) -> None:
        """A state directory resumes the model its checkpoints hold; a run that names another would train the
        checkpoint's model under the new name, so it is refused."""
        recorded = self.store.recorded_model()
        wanted = self.config.model.name_or_path
        if not self.store.kept_checkpoints() or recorded is None or same_model_source(recorded, wanted):
            return
        raise ConfigError(
            f"the state directory {self.store.root} holds checkpoints of model {recorded!r}, not {wanted!r}: "
            f"add --fresh to start {wanted!r} there (its checkpoints and metrics are removed), or use another "
            "--state-dir"
        )

    def _build_transport(self) -> Transport:
        """The transport swarm.transport names (node/transport/__init__.py), over this node's session if it has one."""
        return build_transport(
            self.config,
            self.session,
            self.stats,
            self.fingerprint,
            heartbeat=self.peer_stats,
            on_addresses=self._announce,
        )

    def _announce(self, addresses: list[str]) -> None:
        log.info("node %s listening on %s", self.identity.node_id, " ".join(addresses))
        if self.on_addresses:
            self.on_addresses(addresses)

    @property
    def addresses(self) -> list[str]:
        """Where peers reach this node (none in isolation)."""
        return self.session.addresses if self.session is not None else []

    def peer_stats(self) -> PeerStats:
        """This node's heartbeat content (the transport signs it)."""
        return self.telemetry.heartbeat(
            self.identity.node_id,
            self.model_parameters,
            self.round,
            self.policy_version,
            self.addresses,
            self.averaging,
        )

    def _build_rollouts(self, policy_version: int) -> None:
        # rollout.max_staleness 1: the sampler generates while the trainer steps, so it keeps weights of its own
        self.sampler_model = copy.deepcopy(self.model) if self.config.rollout.max_staleness else self.model
        self.backend = self.build_backend(self.sampler_model, self.tokenizer, policy_version)
        self.local = LocalRollouts(self.config, self.tasks, self.backend)
        rollout = self.config.rollout
        if rollout.over_sample > 0:
            self.partial = PartialRollouts(
                self.backend,
                lambda prompt: self.tokenizer.encode(prompt, add_special_tokens=False),
                self.tasks.prompt,
                rollout.completions_per_question,
                rollout.over_sample,
                rollout.partial_prefix,
            )
        self.sharing = PeerRollouts(
            self.config, self.tasks, self.tokenizer, self.stats, self.telemetry.accuracy_by_dataset, self._refuse
        )
        self.evaluator = HeldoutEvaluator(self.tasks, self.backend)

    @property
    def policy_version(self) -> int:
        return self.trainer.policy_version

    # one round ------------------------------------------------------------------

    def _generation_seed(self, round_: int) -> int:
        return (self.stream_seed * 1_000_003 + round_) % (2**63)

    def _refuse(self, item: ExternalGroup, reason: Refusal, detail: str) -> None:
        self.stats.reject(item.peer_id, reason)
        log.info("refused a question from %s: %s: %s", item.peer_id[:12], reason.value, detail)

    async def start_services(self, stop: asyncio.Event | None = None) -> None:
        """Join the swarm (if any), then the services that need it: averaging, /metrics, the dashboard. `stop` (the
        node is to stop) ends a wait for pipeline stages to be served."""
        self.bind_service_ports()  # before joining; a command that starts a node binds them before loading it
        if self.transport is None:  # one that runs over the swarm session (load() built any other)
            from node.transport.session import join_swarm

            self.session = await join_swarm(
                self.config, self.identity, self.store.root, refusals=self.stats.records, clock_offsets=self.stats.clock
            )
            self.transport = self._build_transport()
        await self.transport.start()
        await self.policy.attach(self.session, self.loaded, seed=self.stream_seed, stop=stop)
        if self.config.averaging.method != "none":
            from node.averaging.service import start_averaging

            if self.averaging is None:  # one given before the start (in-process nodes') is kept, as a transport is
                if self.session is None:
                    raise RuntimeError(
                        "averaging needs the node's own swarm session, or an averaging service given to the node: "
                        "a node given its transport averages with nobody"
                    )
                self.averaging = await start_averaging(
                    self.config, self.session, self.model, self.fingerprint, self.policy_version
                )
            if self._outer_state is not None:
                self.averaging.outer.load_state_dict(self._outer_state)
        await self.start_http()
        if self.config.swarm.dashboard_port is not None:
            from node.dashboard.server import start_node_dashboard

            self._dashboard = await start_node_dashboard(self, self._listening.pop("swarm.dashboard_port"))
        self.progress.services_up()
        self._watchdog = asyncio.create_task(self._watch(), name="round-watchdog")

    async def start_http(self) -> None:
        """Serve /metrics, /healthz and /readyz (swarm.metrics_port), from now on: a command starts it before the
        policy loads, so that a probe sees a node that is loading, not one that does not answer."""
        if self.config.swarm.metrics_port is None or self._metrics_server is not None:
            return
        self.bind_service_ports()
        self._metrics_server = MetricsServer(
            self.config.swarm.metrics_host,
            self.config.swarm.metrics_port,
            self.prometheus,
            self._listening.pop("swarm.metrics_port"),
            readiness=self.readiness,
            url_file=self.store.root / HTTP_FILE,
        )
        await self._metrics_server.start()

    def readiness(self) -> dict[str, Any]:
        """/readyz: joined, training, and the last round within its bound (RoundProgress); a part of the swarm
        connection that died makes it "down". A clock off the swarm's is a `warning` beside: the node still trains,
        and no restart sets a clock right."""
        problem = None
        if self.swarm_lost is not None:
            meanwhile = (
                "training on its own questions meanwhile"
                if self.policy.trains_while_rejoining
                else "the round waits for the swarm, which serves its policy's stages"
            )
            problem = f"rejoining the swarm ({meanwhile}): {self.swarm_lost}"
        elif self.transport is not None and self.progress.up_at is not None:
            try:
                self.transport.check_alive()
            except Exception as exc:  # what the round loop would stop on: reported, the loop decides
                problem = f"{exc}" + (f": {exc.__cause__}" if exc.__cause__ is not None else "")
        report = self.progress.report(problem)
        if (offset := self.stats.clock_totals()["clock_offset_s"]) is not None:
            report["clock_offset_s"] = offset
        if (advice := self.telemetry.clock_advice()) is not None:
            report["warning"] = advice
        return report

    # staying joined ----------------------------------------------------------------------------

    @property
    def rejoins_on_its_own(self) -> bool:
        """Whether a swarm connection that died is rebuilt here: one this node opened itself (swarm.transport=dht),
        for a policy that can be carried over to a new session (both can: a pipeline's router is rebound to it). A
        transport it was given belongs to its giver."""
        return needs_session(self.config) and self.policy.rejoinable

    async def keep_joined(self) -> None:
        """Before each round: when a part of the swarm connection has died (the p2p daemon, the membership, gossip, the
        heartbeat) or the daemon stopped answering (the watchdog's probes), leave what is left of it and rejoin in the
        background with backoff, the same identity and p2p key; the rounds meanwhile train on the node's own
        questions (a pipeline policy's round waits for the swarm: the watchdog also calls this while it does). A node
        that cannot rejoin on its own raises."""
        if self._rejoining is not None:
            if self._rejoining.done():
                self._rejoining.result()  # it ends only once joined again (or by an error that is not the network's)
                self._rejoining = None
            return
        verdict, self._daemon_silent = self._daemon_silent, None
        # a verdict on a session already left (a probe of the old daemon that outlasted the rejoin) says nothing of
        # this one: acting on it would leave a healthy session
        silent = verdict[1] if verdict is not None and verdict[0] is self.session else None
        reason = None
        try:  # asked even when the watchdog found the daemon silent: a daemon that exited says how, which is news
            self.transport.check_alive()
        except Exception as exc:
            if not self.rejoins_on_its_own and silent is None:
                raise
            reason = f"{exc}" + (f": {exc.__cause__}" if exc.__cause__ is not None else "")
        reason = reason or silent
        if reason is not None:
            await self._leave_swarm(reason)
            self._rejoining = asyncio.create_task(self._rejoin(), name="swarm-rejoin")

    async def _watch(self) -> None:
        """The round watchdog: a round past its stall bound is logged once, with the part it is in and every thread's
        stack, and counted; a p2p daemon that leaves its probes unanswered (SwarmSession.probe_daemon) is marked gone
        (the next round's keep_joined replaces it). A round of a policy that cannot train without the swarm (a
        pipeline's: it is blocked on the stages' calls) would never reach the next keep_joined, so for it the watchdog
        runs keep_joined itself, while the round is in a part that calls only the pipeline (never while it publishes
        or collects over the transport that leaving stops); such a round waiting for the rejoin is no stall."""
        probe_s = self.config.swarm.daemon_probe_s
        reported_round, last_probe = None, time.monotonic()
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            report = self.progress.report()
            waits_for_swarm = self.swarm_lost is not None and not self.policy.trains_while_rejoining
            if report["status"] == "stalled" and reported_round != self.round and not waits_for_swarm:
                reported_round = self.round
                self.stats.stalls += 1
                log.warning(
                    "round %d stalled: %s. Where each thread is:\n%s", self.round + 1, report["reason"], thread_stacks()
                )
            if not self.rejoins_on_its_own or self.session is None:
                continue
            if time.monotonic() - last_probe >= probe_s:
                last_probe = time.monotonic()
                probed = self.session
                silent = await probed.probe_daemon(probe_s)
                if silent is not None and self._daemon_silent is None:
                    self._daemon_silent = (probed, silent)
            if (
                not self.policy.trains_while_rejoining
                and self.swarm_lost is None  # not leaving or rejoining already
                and self.progress.phase in ("generating", "training", "evaluating")
            ):
                await self.keep_joined()

    async def _leave_swarm(self, reason: str) -> None:
        self.swarm_lost = reason
        self.stats.swarm_connections_lost += 1
        meanwhile = (
            "training on its own questions" if self.policy.trains_while_rejoining else "the round waits for its stages"
        )
        log.warning("lost the swarm connection (%s): %s, rejoining with the same identity", reason, meanwhile)
        broken, self.transport = self.transport, NullTransport()
        if self.averaging is not None:  # its exchanges ran over the old session; the outer state is kept for the next
            self._outer_state = self.averaging.outer.state_dict()
            averaging, self.averaging = self.averaging, None
            await _best_effort(averaging.stop(), "averaging")
        await _best_effort(broken.stop(), "transport")
        if self.session is not None:
            session, self.session = self.session, None
            await _best_effort(session.close(), "swarm session")

    async def _rejoin(self) -> None:
        """Join again until it works (node.transport.session.rejoin: with backoff)."""
        from node.transport.session import join_swarm, rejoin

        async def attempt() -> Transport:
            self.session = await join_swarm(
                self.config, self.identity, self.store.root, refusals=self.stats.records, clock_offsets=self.stats.clock
            )
            try:
                transport = self._build_transport()
                await transport.start()
                if self.config.averaging.method != "none":
                    from node.averaging.service import start_averaging

                    self.averaging = await start_averaging(
                        self.config, self.session, self.model, self.fingerprint, self.policy_version
                    )
                    if self._outer_state is not None:
                        self.averaging.outer.load_state_dict(self._outer_state)
            except BaseException:
                session, self.session = self.session, None
                await _best_effort(session.close(), "swarm session")
                raise
            return transport

        self.transport, attempts = await rejoin(attempt)
        self.policy.rebind(self.session)  # a pipeline policy's round waiting for its stages goes on over the new one
        self.swarm_lost = None
        self.stats.swarm_rejoins += 1
        log.warning("rejoined the swarm as %s after %d attempt(s)", self.session.peer_id, attempts)

    async def stop_services(self) -> None:
        self.progress.stopping = True
        background = [task for task in (self._rejoining, self._watchdog) if task is not None]
        await cancel_and_wait(background, "the node's watchdog and rejoin")
        for sock in (self._listening or {}).values():  # bound for a server that never started
            sock.close()
        if self._dashboard is not None:
            await self._dashboard.stop()
        if self._metrics_server is not None:
            await self._metrics_server.stop()
        if self.averaging is not None:
            await self.averaging.stop()
        if self.transport is not None:
            await self.transport.stop()
        if self.session is not None:
            await self.session.close()

    async def run_round(self) -> dict[str, Any]:
        """Draw and generate, score, share, train, record: the sharing decisions are node/sharing.py's, the row
        Telemetry's."""
        round_ = self.round + 1
        round_start = time.perf_counter()
        plan = self.plan
        outer_step = self.averaging.apply_if_done() if self.averaging else None
        peers = PeerChoice()
        sharing_s = 0.0
        peers_taken = None
        if plan.collect == "before_drawing":  # own questions then fill the specialties, or the slots, peers left empty
            peers, sharing_s = await self._peer_groups(round_)
            peers_taken = len(peers.groups)
        generated, trained = plan.own_quota(peers_taken)
        self.progress.enter("generating")
        ahead_wait_s = None
        if self._ahead is not None:  # generated while the round before it trained
            waited = time.perf_counter()
            local_groups, summary, timings, generation_work = await self._ahead
            self._ahead, ahead_wait_s = None, time.perf_counter() - waited
        elif self.partial is not None:
            local_groups, summary, timings, generation_work, carried = await self._generate_partial(round_, generated)
        else:
            questions = self.local.draw(
                self.round * plan.draw_stride,  # a gated round may draw more: the stride keeps draws from overlapping
                generated,
                balance_with=peers.groups if plan.balance_draw else None,
                batch_groups=plan.batch_groups,
            )
            local_groups, summary, timings, generation_work = await self._generate(questions, round_)
        if shared := plan.to_publish(local_groups):
            self.progress.enter("publishing")
            await self.transport.publish(round_, self.policy_version, shared)
        if plan.collect == "after_publishing":
            peers, sharing_s = await self._peer_groups(round_)
        sampler_idle_s = None
        if self.config.rollout.max_staleness:  # the next round's own rollouts, from the weights before this update
            sampler_idle_s = self._start_ahead(round_ + 1)
        start = time.perf_counter()
        # not the stream peers' groups are drawn from
        chosen_local = self.local.choose(local_groups, self._generation_seed(round_) ^ 0x5EED, trained)
        replayed = []
        if self.own_replay is not None:
            replayed = self.own_replay.draw()  # before this round's answers join it: a round never replays itself
            self.own_replay.add(local_groups)
        self.progress.enter("training")
        trained_at = self.policy_version
        stats = await asyncio.to_thread(self.trainer.step, plan.training_batch(chosen_local, peers, replayed))
        timings.update_s = time.perf_counter() - start
        if self.averaging:
            self.averaging.maybe_start(self.policy_version)
        if not self.config.rollout.max_staleness:  # else the sampler takes the weights when it next starts
            self.backend.sync_weights(self.model, self.policy_version)
        if self.memory_budget is not None and (shed := self.memory_budget.check()) is not None:
            self.stats.count_shed(shed)
        row = self.telemetry.round_row(
            round_,
            summary,
            stats,
            policy_version=self.policy_version,
            policy_report=self.policy.round_report(self.trainer),
            own_groups=local_groups,
            peer_groups=peers.groups,
            peers_rescored=peers.rescored,
            peers_gated=peers.gated,
            peer_completions_rescored=peers.rescored_completions,
            outer_step=outer_step,
            generation_s=timings.generation_s,
            scoring_s=timings.scoring_s,
            sharing_s=sharing_s,
            update_s=timings.update_s,
            generation_work=generation_work,
        )
        if self.config.rollout.max_staleness:
            row.update(own_staleness(local_groups, trained_at))
            # the overlap's idle time on each side: the round waiting for the rollouts generated during the round before
            # (None: the first, generated now), and the sampler waiting for the round to hand it the next questions and
            # weights (None: it had generated nothing ahead yet)
            row["ahead_wait_s"] = ahead_wait_s
            row["sampler_idle_s"] = sampler_idle_s
        if self.partial is not None:
            row.update(own_staleness(local_groups, trained_at))  # of each completion's oldest token
            row["carried_in"], row["carried_out"] = carried.carried_in, carried.carried_out
        every = self.config.eval_every
        if every and (round_ % every == 0 or round_ == 1):
            await self.settle_rollouts()  # the evaluation samples from the same weights: one sampler at a time
            self.progress.enter("evaluating")
            row["heldout_accuracy"], row["heldout_by_dataset"] = await asyncio.to_thread(self.evaluator.by_dataset)
        row["step_s"] = time.perf_counter() - round_start
        self.store.append_metrics(row)
        self.round = round_
        self.progress.round_done(round_, row["step_s"])
        self.telemetry.record_round(row)
        if self.config.swarm.transport != "none":
            self.stats.save(self.store.root / "swarm.json")
        if round_ % self.config.checkpoint_every == 0:
            self.progress.enter("checkpointing")
            try:
                await asyncio.to_thread(self.save)
            except CheckpointNotSaved as exc:  # a full disk: the checkpoint before stands, and the next save retries
                log.warning(
                    "%s; training goes on and saves again at round %d", exc, round_ + self.config.checkpoint_every
                )
        return row

    async def _generate(self, questions, round_: int):
        """The round's own groups generated and scored in a worker thread, their summary, timings and sampling work."""
        work_before = copy.copy(self.backend.work)
        groups, summary, timings = await asyncio.to_thread(
            self.local.generate_and_score, questions, self._generation_seed(round_)
        )
        return groups, summary, timings, self.backend.work.since(work_before)

    async def _generate_partial(self, round_: int, wanted: int):
        """The round's own groups with partial rollouts (rollout.over_sample): the groups carried from the round before
        resumed and new questions' sampled together until `wanted` are complete, then scored; as `_generate` returns
        them, and what moved between rounds."""
        work_before = copy.copy(self.backend.work)
        # each round may draw up to all it samples: the stride keeps the rounds' draws from overlapping
        questions = self.local.draw(self.round * self.partial.groups_sampled(wanted), self.partial.fresh_needed(wanted))
        start = time.perf_counter()
        sampled = await asyncio.to_thread(self.partial.sample, questions, wanted, self._generation_seed(round_))
        generation_s = time.perf_counter() - start
        scoring = LocalRollouts(self.config, self.tasks, SampledCompletions([c for _, c in sampled.groups]))
        groups, summary, timings = await asyncio.to_thread(
            scoring.generate_and_score, [q for q, _ in sampled.groups], self._generation_seed(round_)
        )
        timings.generation_s = generation_s  # the scoring's "generation" only handed the sampled groups over
        summary["tokens_per_s"] = summary["tokens"] / max(generation_s, 1e-9)
        return groups, summary, timings, self.backend.work.since(work_before), sampled

    async def settle_rollouts(self) -> None:
        """Wait until the rollouts generating ahead (rollout.max_staleness 1), if any, are done: whatever samples next
        (an evaluation, the next round) then has the sampler to itself."""
        if self._ahead is not None:
            await asyncio.wait({self._ahead})

    def _start_ahead(self, round_: int) -> float | None:
        """Start round `round_`'s own rollouts now, from the trainer's weights as they are (before this round's
        update), copied into the sampler's model: the same questions and seed as the serial round would draw. Returns
        how long the sampler sat idle since its last rollouts were done (None: none were generated ahead before)."""
        idle_s = None if self._ahead_done_at is None else time.perf_counter() - self._ahead_done_at
        with torch.no_grad():
            for mine, trainer in zip(self.sampler_model.state_dict().values(), self.model.state_dict().values()):
                mine.copy_(trainer)
        self.backend.sync_weights(self.sampler_model, self.policy_version)
        generated, _ = self.plan.own_quota(None)  # no gate with rollout.max_staleness: what it took changes nothing
        questions = self.local.draw((round_ - 1) * self.plan.draw_stride, generated)
        self._ahead = asyncio.create_task(self._generate(questions, round_), name="rollouts-ahead")
        self._ahead.add_done_callback(self._ahead_finished)
        return idle_s

    def _ahead_finished(self, _: asyncio.Task) -> None:
        self._ahead_done_at = time.perf_counter()

    async def _peer_groups(self, round_: int) -> tuple[PeerChoice, float]:
        """Up to J of the peers' groups received, checked, drawn and re-scored here (node/sharing.py), and the
        seconds it took."""
        start = time.perf_counter()
        self.progress.enter("collecting peers' groups")
        received = await self.transport.collect()
        self.progress.enter("re-scoring peers' groups")
        chosen = await asyncio.to_thread(self.sharing.choose, received, self._generation_seed(round_))
        return chosen, time.perf_counter() - start

    def prometheus(self) -> str:
        if self.trainer is None:  # /metrics answers while the policy loads (start_http): nothing to count yet
            return "# the node is loading its policy\n"
        return self.telemetry.prometheus(self.round, self.policy_version, self.averaging)

    # persistence ---------------------------------------------------------------------

    def save(self) -> None:
        outer = self.averaging.outer.state_dict() if self.averaging else self._outer_state
        self.policy.save(self.round, self.loaded, outer, self.node_state())

    def node_state(self) -> dict | None:
        """What the round loop itself learned and a restart must not lose, beside the policy's own state."""
        return {"own_replay": self.own_replay.state_dict()} if self.own_replay is not None else None

    # the loop ----------------------------------------------------------------------------

    async def run(
        self, rounds: int | None, stop: asyncio.Event, on_round: Callable[[dict[str, Any]], None] | None = None
    ) -> None:
        """Run `rounds` more rounds (None: until `stop` is set); the state is saved on the way out."""
        target = None if rounds is None else self.round + rounds
        try:
            try:
                await self.start_services(stop)
                while not stop.is_set() and (target is None or self.round < target):
                    await self.keep_joined()
                    row = await self.run_round()
                    if on_round:
                        on_round(row)
            except StopRequested as stopped:  # a pipeline stage that may never come back: the round is abandoned
                log.warning("%s; the round in flight is abandoned", stopped)
            self.progress.stopping = True
            # A clean exit keeps every completed round, whatever checkpoint_every says. After an
            # error the weights may be half-updated, so the last checkpoint stands instead.
            latest = self.store.latest()
            if latest is None or self.store.load_round(latest) != self.round:
                await asyncio.to_thread(self.save)
        finally:
            await self.stop_services()
            await self.settle_rollouts()  # rollouts of a round that will not run: let its thread end, keep nothing
            self._ahead = None
            self.backend.close()
