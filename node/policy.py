"""Where a node's policy lives: whole in this process (LocalPolicy), or split into stages that peers
serve (PipelinePolicy: this node drives it, pipeline.objective = grpo). The round loop is the same for
both; only loading, joining and saving differ, and they live here."""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any

import torch

from node.config import NodeConfig
from node.device import HOST, resolve_device
from node.files import atomic_write_text, no_space
from node.model import model_fingerprint, resolve_initial_policy
from node.state import CheckpointNotSaved, StateStore
from node.trainer import GRPOTrainer

log = logging.getLogger(__name__)

PIPELINE_STATE = "pipeline_state.json"  # a pipeline driver's only state: its round and policy version


@dataclass
class LoadedPolicy:
    model: Any
    tokenizer: Any
    trainer: GRPOTrainer
    round: int  # rounds completed
    fingerprint: str  # of the whole model: peers and stage servers compare it
    parameters: int
    rng: dict | None = None  # the random generators' state at the checkpoint, restored once the node is built
    outer_state: dict | None = None  # the averaging's outer optimizer at the checkpoint, applied when averaging starts
    node_state: dict | None = None  # the round loop's own state at the checkpoint (Node.node_state)


class LocalPolicy:
    """The whole model in this process: resumed from the newest checkpoint that loads, or built from the initial
    policy."""

    rejoinable = True  # nothing of it is bound to a swarm session: a node rejoins over a new one (Node.keep_joined)
    trains_while_rejoining = True  # its rounds need no swarm: they train on the node's own questions meanwhile

    def __init__(self, config: NodeConfig, store: StateStore):
        self.config = config
        self.store = store

    def load(self, progress: bool | None = None) -> LoadedPolicy:
        config = self.config
        resumed = self.store.resume(config.model.dtype, config.checkpoint_every)
        device = resolve_device(config.model)
        state = None
        if resumed is not None:
            # a checkpoint is read on the CPU whatever device wrote it; the model and, through load_state_dict, the
            # optimizer's state follow the parameters to this node's device
            checkpoint, state = resumed.path, resumed.state
            model, tokenizer = resumed.model.to(device), resumed.tokenizer
        else:
            torch.manual_seed(config.seed)
            model, tokenizer = resolve_initial_policy(config, progress=progress, device=device)
        model.eval()
        trainer = GRPOTrainer(
            config.trainer,
            model,
            tokenizer.pad_token_id,
            config.rollout.temperature,
            state.policy_version if state is not None else 0,
        )
        if state is None:
            log.info("starting fresh from %s", config.model.name_or_path)
            loaded = LoadedPolicy(model, tokenizer, trainer, 0, "", 0)
        else:
            trainer.optimizer.load_state_dict(state.optimizer)
            log.info(
                "resumed from %s (round %d, policy version %d)", checkpoint.name, state.round, state.policy_version
            )
            loaded = LoadedPolicy(
                model,
                tokenizer,
                trainer,
                state.round,
                "",
                0,
                rng=state.rng,
                outer_state=state.outer,
                node_state=state.node,
            )
        loaded.fingerprint = model_fingerprint(model, tokenizer)
        loaded.parameters = sum(p.numel() for p in model.parameters())
        return loaded

    async def attach(self, session, policy: LoadedPolicy, seed: int, stop: asyncio.Event | None = None) -> None:
        """Nothing to join: the weights are here."""

    def rebind(self, session) -> None:
        """Nothing is bound to the session the node lost: the weights are here."""

    def save(self, round_: int, policy: LoadedPolicy, outer_state: dict | None, node_state: dict | None) -> None:
        trainer = policy.trainer
        self.store.save(
            round_,
            policy.model,
            policy.tokenizer,
            trainer.optimizer,
            trainer.policy_version,
            self.config.checkpoint_keep,
            outer=outer_state,
            node=node_state,
        )

    def round_report(self, trainer: GRPOTrainer) -> dict[str, Any]:
        return {}


class PipelinePolicy:
    """A policy split into pipeline.num_stages stages served by peers: the initial model tells the
    architecture and the fingerprint, the weights stay with the stage servers (which recover a lost
    stage from its neighbours, CheckFree), so this node keeps only its round and policy version."""

    rejoinable = True  # its router is rebound to the new session (rebind)
    # a round is blocked on pipeline calls while the node has no session: the node's watchdog rejoins under it
    trains_while_rejoining = False

    def __init__(self, config: NodeConfig, store: StateStore):
        self.config = config
        self.store = store
        self.router = None  # node.pipeline.driver.PipelineRouter: built by attach, rebound by rebind

    def load(self, progress: bool | None = None) -> LoadedPolicy:
        from node.pipeline.remote_model import RemoteCausalLM, RemoteOptimizer

        config, pipeline = self.config, self.config.pipeline
        torch.manual_seed(config.seed)
        # the driver holds no weight of the policy (the stage servers do, on their devices): the initial model only
        # tells the architecture and the fingerprint, so it stays on the CPU, and so do the driver's few tensors
        initial, tokenizer = resolve_initial_policy(config, device=HOST)
        model = RemoteCausalLM(initial.config, pipeline)
        state = self.store.root / PIPELINE_STATE
        saved = json.loads(state.read_text()) if state.exists() else {"round": 0, "policy_version": 0}
        model.eval()
        trainer = GRPOTrainer(
            config.trainer,
            model,
            tokenizer.pad_token_id,
            config.rollout.temperature,
            saved["policy_version"],
            optimizer=RemoteOptimizer(model),
        )
        loaded = LoadedPolicy(
            model,
            tokenizer,
            trainer,
            saved["round"],
            model_fingerprint(initial, tokenizer),
            sum(p.numel() for p in initial.parameters()),
            node_state=saved.get("node"),
        )
        log.info(
            "driving a policy split in %d stages (model %s), at round %d",
            pipeline.num_stages,
            loaded.fingerprint,
            loaded.round,
        )
        return loaded

    async def attach(self, session, policy: LoadedPolicy, seed: int, stop: asyncio.Event | None = None) -> None:
        """Route the model's stages through the swarm's stage servers (found over `session`, the node's
        node.transport.session.SwarmSession), and wait until each stage is served; `stop` set (the node is to stop)
        ends this wait and any later one for a lost stage (node.aio.StopRequested)."""
        from node.pipeline.driver import PipelineRouter
        from node.pipeline.stages import expected_fingerprints, pipeline_limits

        model_config = policy.model.config
        router = PipelineRouter(
            session.dht,
            self.config,
            policy.fingerprint,
            expected_fingerprints(self.config, model_config, policy.fingerprint),
            pipeline_limits(self.config, model_config, policy.parameters),
            seed=seed,
            stop=stop,
        )
        self.router = router
        policy.model.attach(router, asyncio.get_running_loop())
        await router.wait_until_served()

    def rebind(self, session) -> None:
        """Route over the node's new session (it rejoined the swarm with the same identity and p2p key): the round
        waiting for its stages reads the stage map over it and goes on."""
        if self.router is not None:
            self.router.rebind(session.dht, None)

    def save(self, round_: int, policy: LoadedPolicy, outer_state: dict | None, node_state: dict | None) -> None:
        try:
            atomic_write_text(
                self.store.root / PIPELINE_STATE,
                json.dumps({"round": round_, "policy_version": policy.trainer.policy_version, "node": node_state}),
            )
        except OSError as exc:
            if not no_space(exc):
                raise
            raise CheckpointNotSaved(
                f"could not save round {round_}: no space left on device in {self.store.root}"
            ) from exc

    def round_report(self, trainer: GRPOTrainer) -> dict[str, Any]:
        return {"stage_grad_norms": trainer.optimizer.last_grad_norms}


def policy_for(config: NodeConfig, store: StateStore) -> LocalPolicy | PipelinePolicy:
    return PipelinePolicy(config, store) if config.pipeline.objective == "grpo" else LocalPolicy(config, store)
