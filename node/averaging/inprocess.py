"""Nodes of one process averaging their weights through the real codec and checks, with only the network replaced.

For benchmarks that run several nodes in lockstep (benchmarks/sharing.py), as node/transport/inprocess.py is for
their rollouts. A node's k-th exchange meets the k-th exchanges of the others on one board: with NoLoCo the partner
`pair_partner` names among the board's members for round k (the random pairs the DHT matchmaking agrees on), with
DiLoCo every other member. What a node takes of a partner is what the wire would carry: the partner's snapshot
encoded in the transfer mode (node/weights/codec.py), decoded, and checked as `WeightExchange` checks it. A partner
that has not come within `timeout` is a skipped exchange, as over the network.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter

from node.averaging.matchmaking import pair_partner
from node.averaging.outer import Named
from node.averaging.pairing import AveragingResult
from node.weights.codec import MODES, EncodedWeights, decode_weights, encode_weights
from node.weights.validation import WeightsRefused, validate_partner_weights

KEPT_ROUNDS = 3  # snapshots of the last exchanges kept on the board: a partner triggers within a round or two of us


class InProcessBoard:
    """The network between in-process averagers: each exchange's encoded snapshots, by member."""

    def __init__(self, group_size: int | None = 2) -> None:
        if group_size not in (2, None):
            raise ValueError("group_size must be 2 (NoLoCo pairs) or None (all members)")
        self.group_size = group_size
        self.members: list[str] = []
        self.snapshots: dict[int, dict[str, bytes]] = {}

    def partners(self, member: str, exchange: int) -> list[str]:
        if self.group_size is None:
            return [m for m in self.members if m != member]
        partner = pair_partner(self.members, member, exchange)
        return [partner] if partner is not None else []

    def post(self, member: str, exchange: int, payload: bytes) -> None:
        self.snapshots.setdefault(exchange, {})[member] = payload
        for old in [k for k in self.snapshots if k <= exchange - KEPT_ROUNDS]:
            del self.snapshots[old]


class InProcessAverager:
    """`PairAverager`'s `average` for a member of an `InProcessBoard` (what `OuterStepService` calls)."""

    def __init__(
        self, board: InProcessBoard, member: str, mode: str = "fp32", max_relative_distance: float = 0.5
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; expected one of {MODES}")
        if member in board.members:
            raise ValueError(f"{member!r} is already on the board")
        board.members.append(member)
        self.board, self.member, self.mode = board, member, mode
        self.max_relative_distance = max_relative_distance
        self.refusals: Counter[str] = Counter()  # partners' weights refused, by WeightsRefusal code
        self.exchanges = 0
        self.poll_s = 0.01
        # why the last average() returned None (None: it averaged): "partner_late" or "not_committed" (refused). Never
        # a "no partner" reason: in lockstep a retry would take the next exchange's slot out of turn.
        self.last_skip: str | None = None

    async def average(
        self, theta: Named, round_id: int, timeout: float, find_within: float | None = None
    ) -> AveragingResult | None:
        """The mean of `theta` and the partners' snapshots of this member's next exchange; None when no partner
        came in `timeout` or every partner's weights were refused. `round_id` and `find_within` (the caller's time
        window and what is left of it) are not used: in lockstep the exchange count pairs the members."""
        started = time.perf_counter()
        self.last_skip = None
        exchange, self.exchanges = self.exchanges, self.exchanges + 1
        payload = await asyncio.to_thread(lambda: encode_weights(theta, self.mode).to_bytes())
        self.board.post(self.member, exchange, payload)
        partners = self.board.partners(self.member, exchange)
        deadline = time.monotonic() + timeout
        while any(p not in self.board.snapshots.get(exchange, {}) for p in partners):
            if time.monotonic() >= deadline:
                self.last_skip = "partner_late"
                return None
            await asyncio.sleep(self.poll_s)
        slot = self.board.snapshots[exchange]
        received: dict[str, Named] = {}
        for partner in partners:
            try:
                weights = decode_weights(EncodedWeights.from_bytes(slot[partner]), dtype=None)
                validate_partner_weights(theta, weights, self.max_relative_distance)
            except WeightsRefused as refused:
                self.refusals[refused.reason.value] += 1
                continue
            received[partner] = weights
        if not received:
            self.last_skip = "not_committed"
            return None
        members = [theta, *received.values()]
        mean = {name: sum(m[name].float() for m in members) / len(members) for name in theta}
        return AveragingResult(
            mean_theta=mean,
            partner_ids=sorted(received),
            bytes_sent=len(payload) * len(partners),
            bytes_received=sum(len(slot[p]) for p in partners),
            seconds=time.perf_counter() - started,
            round_id=exchange,
        )

    async def stop(self) -> None:
        return None
