"""A causal LM whose layers live on stage servers: the RL loop's policy when it trains through the pipeline.

`RemoteCausalLM` answers the two ways the node calls a policy, so that `node/loop.py`'s
sampler and GRPO trainer run unchanged on a model no single node holds:

- `model(input_ids, attention_mask, position_ids)` with autograd on: the forward travels a
  random route (one live server per stage; CheckFree+ swaps on odd calls), the logits come
  back, and `loss.backward()` sends their gradient back along the same route through an
  autograd Function (as Petals' RemoteSequential does). `RemoteOptimizer.step()` then asks
  every server the update touched to clip and apply its gradients (a step some stage did not
  apply is no policy version: `StepNotApplied`).
- `model(..., use_cache=True[, past_key_values=session])` without autograd: an inference
  session. Each server keeps a per-session KV cache of its layers (Petals' inference
  sessions); the session pins one server per stage and keeps the tokens it has seen, so
  that if a server dies mid-generation the session is replayed on a fresh route.

The sampler and trainer call the model from a worker thread; the pipeline calls run on
the node's asyncio loop (`run_coroutine_threadsafe`). Weights never live here: the node
has no policy checkpoint of its own (its stage servers recover from each other).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field

import torch

from node.config import PipelineConfig
from node.pipeline.client import HopFailed
from node.pipeline.driver import PipelineRouter, StageLost, route_hops, route_order
from node.pipeline.tensors import from_wire
from node.trainer.grpo import StepNotApplied
from protocol import StageAnnouncement

log = logging.getLogger(__name__)

CALL_SLACK_S = 600.0  # a blocked worker thread gives up on the loop only far beyond any call timeout


@dataclass
class RemoteOutput:
    logits: torch.Tensor
    past_key_values: "RemoteSession | None" = None


@dataclass
class RemoteSession:
    """One generation's state: the servers pinned to it and every token it has fed them."""

    session_id: str
    route: dict[int, StageAnnouncement]
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    replays: int = 0

    def get_seq_length(self) -> int:  # what HF code asks a cache for
        return self.input_ids.shape[1]


@dataclass
class _Touched:
    servers: dict[str, StageAnnouncement] = field(default_factory=dict)


class _PipelineFunction(torch.autograd.Function):
    """Forward through a route; backward retraces it. `anchor` only makes autograd call backward."""

    @staticmethod
    def forward(ctx, anchor, input_ids, attention_mask, position_ids, model):  # noqa: D401 - torch signature
        logits, route, hops, prefix = model._train_forward(input_ids, attention_mask, position_ids)
        ctx.model, ctx.route, ctx.hops, ctx.prefix = model, route, hops, prefix
        return logits

    @staticmethod
    def backward(ctx, grad_logits):
        ctx.model._train_backward(ctx.route, ctx.hops, ctx.prefix, grad_logits)
        return None, None, None, None, None


class RemoteCausalLM(torch.nn.Module):
    def __init__(self, hf_config, pipeline: PipelineConfig) -> None:
        super().__init__()
        self.config = hf_config
        self.pipeline = pipeline  # the stage count, CheckFree+'s swaps and the attempts a micro-batch gets
        self.anchor = torch.nn.Parameter(torch.zeros(()))  # no weight of the policy is here; see the module docstring
        self.router: PipelineRouter | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.touched = _Touched()
        self.backward_failures = 0
        self._calls = itertools.count()
        self._sessions: list[RemoteSession] = []

    def attach(self, router: PipelineRouter, loop: asyncio.AbstractEventLoop) -> None:
        self.router, self.loop = router, loop

    def _run(self, coro):
        if self.router is None:
            raise RuntimeError("the remote policy is not attached to a pipeline yet (the node's services start it)")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(CALL_SLACK_S)

    # HF-style entry point -----------------------------------------------------------------

    def forward(
        self,
        input_ids,
        attention_mask=None,
        position_ids=None,
        use_cache: bool = False,
        past_key_values=None,
        logits_to_keep: int = 0,
        **_,
    ):
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if position_ids is None:
            position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)[:, -input_ids.shape[1] :]
        if use_cache or past_key_values is not None:
            logits, session = self._run(self._infer(input_ids, attention_mask, position_ids, past_key_values))
            return RemoteOutput(
                logits=logits[:, -logits_to_keep:] if logits_to_keep else logits, past_key_values=session
            )
        if torch.is_grad_enabled():
            return RemoteOutput(
                logits=_PipelineFunction.apply(self.anchor, input_ids, attention_mask, position_ids, self)
            )
        logits = self._run(self._forward_once(input_ids, attention_mask, position_ids, train=False))[0]
        return RemoteOutput(logits=logits[:, -logits_to_keep:] if logits_to_keep else logits)

    # training ------------------------------------------------------------------------------

    def _train_forward(self, input_ids, attention_mask, position_ids):
        logits, route, hops, prefix = self._run(self._forward_once(input_ids, attention_mask, position_ids, train=True))
        for server in route.values():
            self.touched.servers[server.node_id] = server
        return logits, route, hops, prefix

    def _train_backward(self, route, hops, prefix, grad_logits) -> None:
        try:
            self._run(self.router.backward(route, hops, prefix, grad_logits.detach().float().contiguous()))
        except HopFailed as failure:
            # Stages after the failed hop keep this micro-batch's gradient; the ones before it cannot get it.
            self.router.fail(failure)
            self.backward_failures += 1

    async def _forward_once(self, input_ids, attention_mask, position_ids, train: bool):
        index = next(self._calls)
        p = self.pipeline
        order = route_order(
            p.num_stages, index, p.checkfree_plus and train, p.checkfree_plus_swap_every, p.checkfree_plus_swap_last
        )
        hops = route_hops(p.num_stages, order)
        while True:
            for attempt in range(self.pipeline.attempts_per_micro_batch):
                try:
                    route = await self.router.pick_route(hops)
                    prefix = f"p{index}-a{attempt}-{time.time_ns() % 10**9}"
                    logits = await self.router.forward(
                        route, hops, prefix, input_ids, position_ids, attention_mask.long(), train=train
                    )
                    return logits.float(), route, hops, prefix
                except HopFailed as failure:
                    self.router.fail(failure)
                except StageLost as lost:
                    log.warning("%s: waiting for the stage to be served again", lost)
                    break
            await self.router.wait_until_served()

    # generation ----------------------------------------------------------------------------

    async def _infer(self, input_ids, attention_mask, position_ids, session: RemoteSession | None):
        stages = self.pipeline.num_stages
        hops = route_hops(stages, list(range(stages)))
        if session is None:
            for old in self._sessions:  # the sampler runs one generation at a time: older sessions are done
                await self._end(old)
            session = RemoteSession(
                f"g{next(self._calls)}-{time.time_ns() % 10**9}",
                {},
                input_ids[:, :0],
                attention_mask[:, :0],
                position_ids[:, :0],
            )
            self._sessions = [session]
        new_ids, new_positions = input_ids, position_ids
        session.input_ids = torch.cat([session.input_ids, new_ids], dim=1)
        session.position_ids = torch.cat([session.position_ids, new_positions], dim=1)
        session.attention_mask = attention_mask.long()
        while True:
            try:
                if not session.route:  # a new session, or a replay after a failure: feed everything seen so far
                    session.route = await self.router.pick_route(hops)
                    x, positions = session.input_ids, session.position_ids
                    logits = await self._infer_hops(session, hops, x, positions)
                    return logits[:, -new_ids.shape[1] :], session
                return await self._infer_hops(session, hops, new_ids, new_positions), session
            except HopFailed as failure:
                self.router.fail(failure)
            except StageLost as lost:
                log.warning("%s: generation waits for the stage to be served again", lost)
                await self.router.wait_until_served()
            session.route = {}
            session.session_id = f"{session.session_id.split('~')[0]}~{session.replays + 1}"
            session.replays += 1

    async def _infer_hops(self, session: RemoteSession, hops, x, positions):
        for stage, parts in hops:
            server = session.route[stage]
            call = self.router._call(
                "infer",
                server,
                session.session_id,
                parts,
                tensors={
                    "input_ids" if parts[0] == "embed" else "hidden": x,
                    "position_ids": positions,
                    "attention_mask": session.attention_mask,
                },
            )
            result = await self.router.call(server, call)
            x = from_wire(result.tensors["output"])
        return x.float()

    async def _end(self, session: RemoteSession) -> None:
        for server in session.route.values():
            try:
                await self.router.call(server, self.router._call("end_session", server, session.session_id))
            except HopFailed:
                pass  # its cache expires there on its own


class RemoteOptimizer:
    """The trainer's optimizer for a remote policy: `step()` makes every touched stage server apply its gradients.

    A step that a touched stage did not apply (none of its servers answered: a server died, or this node's
    connection did) raises StepNotApplied, so that it counts as no policy version. Each server that did not answer
    may still hold the step's gradients, which would add to the next update's: it is sent a drop (a step of scale 0,
    under a call id of its own), and, if it answers that neither, once more before the next update accumulates
    anything (`zero_grad`: by then a node that lost its connection has rejoined). Past that it is owed nothing."""

    def __init__(self, model: RemoteCausalLM) -> None:
        self.model = model
        self.param_groups: list[dict] = []
        self.last_grad_norms: dict[int, float] = {}
        self.owed_drops: dict[str, StageAnnouncement] = {}  # node id -> a server that answered neither step nor drop

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.model.anchor.grad = None  # stage servers zero their own gradients after each step
        if self.owed_drops:
            owed, self.owed_drops = self.owed_drops, {}
            self._drop(owed)

    def step(self) -> None:
        touched, self.model.touched = self.model.touched.servers, _Touched()
        outcome = self.model._run(self.model.router.step(touched, scale=1.0, step_id=f"grpo-{time.time_ns()}"))
        self.last_grad_norms = outcome.grad_norms
        if outcome.unanswered:
            self.owed_drops.update(self._drop(outcome.unanswered))
        missed = sorted({server.stage for server in touched.values()} - set(outcome.grad_norms))
        if missed:
            raise StepNotApplied(f"stage(s) {', '.join(map(str, missed))} did not answer the step")

    def _drop(self, servers: dict[str, StageAnnouncement]) -> dict[str, StageAnnouncement]:
        """Drop what `servers` accumulated, best effort: those that did not answer."""
        outcome = self.model._run(self.model.router.step(servers, scale=0.0, step_id=f"drop-{time.time_ns()}"))
        return outcome.unanswered

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        return None
