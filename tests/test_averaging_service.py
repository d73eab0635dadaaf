"""When the outer-step service starts an exchange (node/averaging/service.py), with a clock and an averager of the
test's own: peers meet in time windows, so a node looks for a partner only until its window ends, and an exchange
that found none is tried again in the next window rather than after another H updates.

Across two hosts, before this rule, two nodes whose attempts fell in different windows kept missing each other
(benchmarks/notebook/2026-11-27-two-hosts.md
"two hosts"); the real matchmaking's end at the window is tested in tests/test_averaging_pairing.py."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import torch

from node.averaging.pairing import AveragingResult
from node.averaging.service import OuterStepService
from node.config import load_config

REPO = Path(__file__).resolve().parents[1]


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class ScriptedAverager:
    """Answers each exchange with the next outcome of its script ("averaged", or the reason it skipped, as
    PairAverager.last_skip says it); records the calls."""

    def __init__(self, outcomes: list[str]) -> None:
        self.outcomes = list(outcomes)
        self.calls: list[dict] = []
        self.refusals: Counter[str] = Counter()
        self.last_skip: str | None = None

    async def average(self, theta, round_id: int, timeout: float, find_within: float | None = None):
        self.calls.append({"round_id": round_id, "timeout": timeout, "find_within": find_within})
        outcome = self.outcomes.pop(0)
        self.last_skip = None if outcome == "averaged" else outcome
        if self.last_skip:
            return None
        return AveragingResult(
            mean_theta={k: v.clone() for k, v in theta.items()},
            partner_ids=["partner"],
            bytes_sent=1,
            bytes_received=1,
            seconds=0.0,
            round_id=round_id,
        )

    async def stop(self) -> None:
        return None


def service(outcomes: list[str], clock: Clock) -> tuple[OuterStepService, ScriptedAverager]:
    config = load_config(
        REPO / "configs" / "swarm.yaml",
        ["averaging.method=noloco", "averaging.every_steps=3", "averaging.window_s=10", "averaging.timeout_s=20"],
    )
    averager = ScriptedAverager(outcomes)
    return OuterStepService(config, torch.nn.Linear(2, 2), averager, clock=clock), averager


def test_a_skipped_exchange_is_tried_again_in_the_next_window_and_an_averaged_one_waits_h_updates():
    async def scenario():
        clock = Clock(1003.5)  # window 100, 6.5 s of it left
        svc, averager = service(["no_partner_in_window", "averaged", "averaged"], clock)
        assert not svc.maybe_start(2)  # H = 3 updates have not passed
        assert svc.maybe_start(3)
        await svc.wait_exchange()
        assert averager.calls[-1] == {"round_id": 100, "timeout": 20, "find_within": 6.5}
        assert svc.apply_if_done() == {"outcome": "skipped"}

        clock.now = 1008.0
        assert not svc.maybe_start(4)  # one attempt per window: peers meet by window
        clock.now = 1011.0
        assert svc.maybe_start(4)  # the next window: at once, not 3 updates after the skipped attempt
        await svc.wait_exchange()
        assert averager.calls[-1] == {"round_id": 101, "timeout": 20, "find_within": 9.0}
        assert svc.apply_if_done()["outcome"] == "averaged"

        clock.now = 1025.0
        assert not svc.maybe_start(6)  # 2 updates since the version that averaged (4)
        assert svc.maybe_start(7)
        await svc.wait_exchange()
        assert averager.calls[-1]["round_id"] == 102
        assert svc.apply_if_done()["outcome"] == "averaged"
        assert (svc.stats.attempted, svc.stats.succeeded, svc.stats.skipped) == (3, 2, 1)
        assert svc.last_trigger_version == 7

    asyncio.run(scenario())


def test_weights_that_moved_and_were_refused_wait_h_updates():
    async def scenario():
        clock = Clock(1003.5)
        svc, averager = service(["not_committed", "no_partner", "averaged"], clock)
        assert svc.maybe_start(3)
        await svc.wait_exchange()
        assert svc.apply_if_done() == {"outcome": "skipped"}
        clock.now = 1011.0
        assert not svc.maybe_start(5)  # refused (or broken) after the weights moved: they would be refused again
        assert svc.maybe_start(6)
        await svc.wait_exchange()
        assert svc.apply_if_done() == {"outcome": "skipped"}  # nobody came: the next window tries again
        clock.now = 1021.0
        assert svc.maybe_start(6)
        await svc.wait_exchange()
        assert [call["round_id"] for call in averager.calls] == [100, 101, 102]

    asyncio.run(scenario())
