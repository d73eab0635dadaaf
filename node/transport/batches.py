"""Rollout batches on the way out and in, whatever carries them (DHT records, gossip, an in-process exchange).

Out: a node's scored groups become one `RolloutBatch` (its completions' text, token ids and
behaviour log-probs, and its own rewards as advisory claims), signed by the transport.
In: `BatchReceiver` turns raw values into `ExternalGroup`s. A value already processed (the same DHT
value is read again every round, and gossip delivers it too) is skipped by its digest before any
decoding; of the new ones, at most a round's budget is taken, at random, and the rest counted as left
unread (a flood costs the reader a bounded amount of work). Each is decoded and verified by the
protocol (signature, swarm, size, structure), checked against the DHT subkey it was stored under,
counted once if refused, skipped if already seen (the same DHT value is read again every round),
refused as a replay if it may be one used and forgotten (at or below the highest seq of its sender that the
bounded memory let go), or as stale if older than
`swarm.max_batch_age_s`. Re-scoring and choosing what to train on is the node's job (node/sharing.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import random

from node.config import SwarmConfig
from node.stats import ClockOffsets, SwarmStats
from node.rollouts.base import ExternalGroup, RolloutGroup
from protocol import (
    DEFAULT_LIMITS,
    Limits,
    MessageKind,
    ProtocolRejection,
    Refusal,
    RolloutBatch,
    RolloutCompletion,
    RolloutQuestion,
    decode_message,
)
from protocol.bounded import BoundedDict

log = logging.getLogger(__name__)

SEEN_PER_SENDER = 64
MAX_SENDERS_REMEMBERED = 1024
MAX_REFUSED_REMEMBERED = 4096
MAX_PROCESSED_REMEMBERED = 8192  # digests of values decoded already: more than a round's reads of several windows


def rollout_batch(fingerprint: str, round_: int, policy_version: int, groups: list[RolloutGroup]) -> RolloutBatch:
    """The batch a node publishes for its scored groups (unsigned: the transport signs it)."""
    questions = [
        RolloutQuestion(
            spec=group.spec,
            completions=[
                RolloutCompletion(
                    text=c.text, token_ids=list(c.completion_ids), logprobs=c.logprobs, finish_reason=c.finish_reason
                )
                for c in group.completions
            ],
            claimed_rewards=[float(r) for r in group.rewards],
        )
        for group in groups
    ]
    return RolloutBatch(round=round_, policy_version=policy_version, model_fingerprint=fingerprint, questions=questions)


def sign_rollout_batch(writer, fingerprint: str, round_: int, policy_version: int, groups: list[RolloutGroup]):
    """(the signed record, how many groups it holds): as many of the first groups as fit in one message."""
    keep = len(groups)
    while True:
        try:
            record = writer.sign(rollout_batch(fingerprint, round_, policy_version, groups[:keep]))
            break
        except ProtocolRejection as exc:
            if exc.reason is not Refusal.TOO_LARGE or keep <= 1:
                raise
            keep = keep // 2
    if keep < len(groups):
        log.warning(
            "round %d: the batch of %d questions exceeds the message limit; published the first %d",
            round_,
            len(groups),
            keep,
        )
    return record, keep


def decode_verified(
    raw: object,
    subkey: object,
    swarm_id: str,
    kind: MessageKind,
    now: float,
    limits: Limits = DEFAULT_LIMITS,
    clock_offsets: ClockOffsets | None = None,
):
    """Decode a DHT or gossip value and check that it is what its DHT subkey (if any) claims.

    A value signed in the future (past the clock skew allowed) is refused as stale; how old a
    value may be is the caller's to decide (a heartbeat, a batch and an announcement differ),
    so a record the DHT still holds is never refused for its age alone. Its signing time is given to
    `clock_offsets` once its signature holds, whatever is refused after. Raises ProtocolRejection.
    """
    if not isinstance(raw, bytes):
        raise ProtocolRejection(Refusal.BAD_STRUCTURE, f"DHT value is {type(raw).__name__}, not bytes")
    envelope = decode_message(raw, swarm_id=swarm_id, limits=dataclasses.replace(limits, max_clock_skew_s=float("inf")))
    if clock_offsets is not None:
        clock_offsets.observe(envelope.sender_id, envelope.timestamp, now)
    if envelope.timestamp > now + limits.max_clock_skew_s:
        raise ProtocolRejection(
            Refusal.STALE, f"signed {envelope.timestamp - now:.0f}s in the future, limit {limits.max_clock_skew_s:.0f}s"
        )
    if subkey is not None and envelope.sender_id != subkey:
        raise ProtocolRejection(
            Refusal.SENDER_MISMATCH, f"signed by {envelope.sender_id[:12]}… but stored as {str(subkey)[:12]}…"
        )
    if envelope.kind != kind:
        raise ProtocolRejection(Refusal.BAD_STRUCTURE, f"expected {kind.value}, got {envelope.kind.value}")
    return envelope


def value_digest(raw: object) -> bytes:
    return hashlib.sha256(raw if isinstance(raw, bytes) else repr(raw).encode()).digest()[:16]


class SenderSeqs(set[int]):
    """The seqs remembered of one sender, and the highest seq let go to stay bounded (-1: none)."""

    forgotten_up_to = -1


class SeenEnvelopes:
    """Which (sender, seq) pairs were processed, so that re-reading a DHT value is not a replay.

    Bounded: the SEEN_PER_SENDER highest seqs of the MAX_SENDERS_REMEMBERED most recent senders (throwaway
    identities cannot grow it without bound). What it lets go of a sender is always its lowest seq, kept as one
    number: at or below it an unseen seq may be one that was used and forgotten, above it "unseen" is exact.
    """

    def __init__(self) -> None:
        self._by_sender: BoundedDict[str, SenderSeqs] = BoundedDict(MAX_SENDERS_REMEMBERED)

    def seen(self, sender: str, seq: int) -> bool:
        return seq in self._by_sender.get(sender, ())

    def remembered(self) -> dict[str, int]:
        """How many seqs are remembered of each sender remembered (what the bounds above cap)."""
        return {sender: len(seqs) for sender, seqs in self._by_sender.items()}

    def forgotten_up_to(self, sender: str) -> int:
        """The highest seq of `sender` let go to stay bounded (-1: none, or the sender forgotten whole): at or below
        it, "seen" can no longer be told."""
        seqs = self._by_sender.get(sender)
        return -1 if seqs is None else seqs.forgotten_up_to

    def add(self, sender: str, seq: int) -> None:
        seqs = self._by_sender.get(sender)
        seqs = SenderSeqs() if seqs is None else seqs
        self._by_sender[sender] = seqs  # the most recently active sender now
        seqs.add(seq)
        if len(seqs) > SEEN_PER_SENDER:
            lowest = min(seqs)
            seqs.remove(lowest)
            seqs.forgotten_up_to = max(seqs.forgotten_up_to, lowest)


class BatchReceiver:
    """Turns the raw rollout values a transport read (DHT subkey or None for a push, bytes) into peers' groups."""

    def __init__(self, config: SwarmConfig, own_id: str, fingerprint: str, stats: SwarmStats):
        self.config = config
        self.own_id = own_id
        self.fingerprint = fingerprint
        self.stats = stats
        self.seen = SeenEnvelopes()
        self.refused: BoundedDict[bytes, None] = BoundedDict(MAX_REFUSED_REMEMBERED)
        # digests of values decoded already
        self.processed: BoundedDict[bytes, None] = BoundedDict(MAX_PROCESSED_REMEMBERED)

    def receive(
        self, values: list[tuple[object, object]], now: float, budget: int | None = None
    ) -> list[ExternalGroup]:
        """Peers' groups from the values not processed before, at most `budget` of them decoded (None: all)."""
        fresh, digests = [], set()
        for subkey, raw in values:
            digest = value_digest(raw)
            if subkey == self.own_id or digest in self.processed or digest in digests:
                continue
            digests.add(digest)
            fresh.append((subkey, raw, digest))
        if budget is not None and len(fresh) > budget:
            self.stats.values_left_unread += len(fresh) - budget
            fresh = random.sample(fresh, budget)
        self.stats.values_decoded += len(fresh)
        envelopes = []
        for subkey, raw, digest in fresh:
            self.processed[digest] = None
            try:
                envelope = decode_verified(
                    raw,
                    subkey,
                    self.config.swarm_id,
                    MessageKind.ROLLOUT_BATCH,
                    now,
                    clock_offsets=self.stats.clock,
                )
            except ProtocolRejection as exc:
                self.refuse_once(str(subkey)[:64] if subkey is not None else "gossip", raw, exc)
                continue
            if envelope.sender_id != self.own_id:
                envelopes.append((envelope, len(raw)))
        groups: list[ExternalGroup] = []
        for envelope, size in sorted(envelopes, key=lambda pair: pair[0].seq):
            peer = envelope.sender_id
            if self.seen.seen(peer, envelope.seq):
                continue  # the same value read again from the DHT: not news, not a replay
            counters = self.stats.peer(peer)
            counters.batches_received += 1
            self.stats.bytes_received += size
            if envelope.seq <= self.seen.forgotten_up_to(peer):
                # It may be one we used and had to forget. An unseen batch older than what we remember but above
                # anything forgotten is not a replay: gossip and DHT deliver out of order under load, and a late
                # DHT read of an honest peer's older batch after its newer push is first contact, not a repeat.
                self.stats.reject(peer, Refusal.REPLAY)
                self.seen.add(peer, envelope.seq)
                continue
            self.seen.add(peer, envelope.seq)
            if now - envelope.timestamp > self.config.max_batch_age_s:
                self.stats.reject(peer, Refusal.STALE)
                continue
            batch: RolloutBatch = envelope.message
            counters.batches_accepted += 1
            counters.questions_received += len(batch.questions)
            same_model = batch.model_fingerprint == self.fingerprint
            for question in batch.questions:
                groups.append(
                    ExternalGroup(
                        spec=question.spec,
                        completions=question.completions,
                        claimed_rewards=question.claimed_rewards,
                        peer_id=peer,
                        same_model=same_model,
                        policy_version=batch.policy_version,
                    )
                )
        return groups

    def refuse_once(self, peer: str, raw: object, rejection: ProtocolRejection) -> None:
        """Count a refused value the first time it is read (it stays in the DHT until it expires)."""
        digest = value_digest(raw)
        if digest in self.refused:
            return
        self.refused[digest] = None
        self.stats.reject(peer, rejection.reason)
        log.info("refused a value stored as %s: %s", peer[:12], rejection)
