"""The outer-step service: NoLoCo (or DiLoCo) averaging beside training, never blocking it.

Every `every_steps` policy updates the node snapshots its weights theta and starts an
exchange in the background (pairing.py); training goes on. When the exchange ends, the
outer step is applied between two rounds: new theta from the rule (outer.py), plus the
inner steps taken while the exchange ran (Streaming DiLoCo's idea, outer.apply_with_drift).
An exchange that finds no partner in time, or whose partner's weights are refused, is
skipped: the weights stay as training left them.

Peers meet in time windows (`window_s`): the round of an exchange is the window it starts in, so two peers meet
only if both look for a partner in the same window. A node therefore looks for one only until its window ends (an
exchange begun by then may run to `timeout_s`), and an exchange that found nobody is tried again in the next window
rather than `every_steps` updates later. Without both, two nodes whose attempts fell in different windows kept
missing each other (two hosts, `every_steps` 20, `window_s` 10: 5 exchanges averaged a node in 600 s before, 17
after; benchmarks/notebook/2026-11-27-two-hosts.md). Weights that moved and were refused wait `every_steps` updates:
they would be refused again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from node.aio import cancel_and_wait
from node.averaging.outer import OuterOptimizerState, apply_with_drift, diloco_step, float_parameters, noloco_step
from node.weights.validation import relative_distance
from node.config import NodeConfig
from node.device import HOST

log = logging.getLogger(__name__)

# an averager's `last_skip` reasons after which the next window tries again (no partner was there to exchange with)
RETRIED_SKIPS = frozenset({"no_partner", "no_partner_in_window"})


@dataclass
class AveragingStats:
    attempted: int = 0
    succeeded: int = 0
    skipped: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    last_partners: list[str] = field(default_factory=list)
    last_seconds: float = 0.0
    last_distance: float = 0.0  # relative L2 distance of our theta to the group mean, at the last success


class OuterStepService:
    def __init__(
        self, config: NodeConfig, model: torch.nn.Module, averager, clock: Callable[[], float] = time.time
    ) -> None:
        self.config = config.averaging
        self.model = model
        self.averager = averager  # a started pairing.PairAverager (or one with its average(), last_skip, refusals)
        self.outer = OuterOptimizerState.from_model(model)
        self.stats = AveragingStats()
        self.clock = clock  # wall-clock seconds: peers agree on a window by the time, not by a message
        self.last_trigger_version = 0  # the policy version of the last exchange that averaged (or of the start)
        self._last_window = -1
        self._attempt_version = 0  # the policy version at which the exchange in flight started
        self._task: asyncio.Task | None = None
        self._theta_sent: dict[str, torch.Tensor] | None = None

    @property
    def in_flight(self) -> bool:
        """An exchange was started and not applied yet (it may have finished: `apply_if_done` applies it)."""
        return self._task is not None

    @property
    def theta_sent(self) -> dict[str, torch.Tensor] | None:
        """The weights the exchange in flight sent to its partners (None when none is)."""
        return self._theta_sent

    async def wait_exchange(self) -> None:
        """Until the exchange in flight has finished (its outcome is applied by `apply_if_done`)."""
        if self._task is not None:
            await asyncio.wait([self._task])

    def maybe_start(self, policy_version: int) -> bool:
        """Start an exchange when H updates have passed since the last one that averaged, none is in flight, and
        none started in this window yet."""
        if self._task is not None or policy_version - self.last_trigger_version < self.config.every_steps:
            return False
        now = self.clock()
        window = int(now // self.config.window_s)
        if window == self._last_window:
            return False  # one exchange per window: peers pair up by window
        self._last_window = window
        self._attempt_version = policy_version
        # the snapshot leaves the device here: the exchange and the outer rule never touch the live parameters
        self._theta_sent = {
            k: v.detach().to(HOST, torch.float32).clone() for k, v in float_parameters(self.model).items()
        }
        # a peer that becomes ready after this window ends looks in the next window's round, not in ours (measured
        # after the snapshot, which may take a while off a device)
        find_within = (window + 1) * self.config.window_s - self.clock()
        self.stats.attempted += 1
        self._task = asyncio.create_task(
            self.averager.average(
                self._theta_sent, round_id=window, timeout=self.config.timeout_s, find_within=find_within
            ),
            name="outer-step",
        )
        return True

    def apply_if_done(self) -> dict | None:
        """Apply a finished exchange (call between rounds, when no torch work runs); its stats, or None."""
        if self._task is None or not self._task.done():
            return None
        task, theta_sent, self._task, self._theta_sent = self._task, self._theta_sent, None, None
        result = task.result()  # the averager returns None for every expected failure; anything else is a bug
        if result is None:
            self.stats.skipped += 1
            # nobody to exchange with in that window: the next window may have someone, so try again there; weights
            # that moved and were refused (or a broken stream) wait H updates, as they would be refused again
            if self.averager.last_skip not in RETRIED_SKIPS:
                self.last_trigger_version = self._attempt_version
            return {"outcome": "skipped"}
        self.last_trigger_version = self._attempt_version
        if self.config.method == "noloco":
            new_theta = noloco_step(
                self.outer, theta_sent, result.mean_theta, self.config.momentum(), self.config.outer_lr
            )
        else:
            new_theta = diloco_step(
                self.outer, self.outer.outer_delta(result.mean_theta), self.config.outer_lr, self.config.momentum()
            )
        params = float_parameters(self.model)
        # the rule runs on the CPU in fp32 (where phi and the partners' weights are); the result goes back to the
        # parameters' device and dtype
        now = {k: v.detach().to(HOST, torch.float32) for k, v in params.items()}
        final = apply_with_drift(now, theta_sent, new_theta)
        with torch.no_grad():
            for name, param in params.items():
                param.copy_(final[name].to(param.device, param.dtype))
        self.stats.succeeded += 1
        self.stats.bytes_sent += result.bytes_sent
        self.stats.bytes_received += result.bytes_received
        self.stats.last_partners = list(result.partner_ids)
        self.stats.last_seconds = result.seconds
        self.stats.last_distance = relative_distance(result.mean_theta, theta_sent)
        return {
            "outcome": "averaged",
            "partners": self.stats.last_partners,
            "seconds": result.seconds,
            "bytes_sent": result.bytes_sent,
            "bytes_received": result.bytes_received,
            "distance": self.stats.last_distance,
        }

    def counters(self) -> dict:
        stats = self.stats
        return {
            "attempted": stats.attempted,
            "succeeded": stats.succeeded,
            "skipped": stats.skipped,
            "bytes_sent": stats.bytes_sent,
            "bytes_received": stats.bytes_received,
            "last_distance": stats.last_distance,
            "refusals": dict(self.averager.refusals),
        }

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task], "averaging service")
        await self.averager.stop()


async def start_averaging(
    config: NodeConfig, session, module: torch.nn.Module, fingerprint: str, last_version: int
) -> OuterStepService:
    """NoLoCo (a pair per round) or DiLoCo (all live peers) averaging of `module` with the peers whose model has
    the same `fingerprint`, over the node's swarm session (node/transport/session.py: its DHT node and p2p daemon,
    announcements signed by its writer); the first exchange after `every_steps` updates past `last_version`. The
    whole model of a node and one pipeline stage alike."""
    from node.averaging.fingerprint import averaging_prefix
    from node.averaging.pairing import PairAverager

    averaging = config.averaging
    averager = PairAverager(
        session.dht,
        averaging_prefix(config.swarm.swarm_id, fingerprint),
        group_size=2 if averaging.method == "noloco" else None,
        mode=averaging.transfer_dtype,
        max_relative_distance=averaging.max_relative_distance,
        writer=session.writer,
        addresses=lambda: session.addresses,  # as the session's membership refreshes them, not as they were at start
    )
    await averager.start()
    service = OuterStepService(config, module, averager)
    service.last_trigger_version = last_version
    return service
