"""A crowd: M peers played from one process next to one real node, to measure whether a node's cost grows with the
swarm.

Each crowd member is a signing identity of its own that publishes, through one DHT peer this
process runs, what a real node publishes: a signed heartbeat under its heartbeat shard and a
signed batch of rollout groups under its rollout shards (protocol/shards.py), each window. The
batches are valid and useful: questions of the node's own task mix with one right answer and
wrong ones, so the node draws them, re-scores them and trains on them. The real node cannot
tell the crowd from M real peers; only the DHT peer that stores their records is shared (in a
real swarm of M nodes the records would spread over M DHT peers, so the real node joins as a
DHT client here: it stores none of the crowd's records, as a node of a large swarm stores a
small share of them).

The benchmark runs one real node (`swarm-node join`, a subprocess: the crowd's signing and storing
must not share its interpreter) and grows the crowd in phases: alone (the crowd's DHT peer only),
then M = 4, 64, 256, 1024 (by default). In each phase it lets the node see the new size, then
measures the rounds of `--measure_s` seconds: round time (metrics.jsonl `step_s`), bytes and values read per
round and groups re-scored per round (`swarm.json` totals, metrics `external_rescored`), the node's
RSS, and `swarm-node peers --json` (time, count). It ends with one JSON line.

    PYTHONPATH=. python benchmarks/crowd.py --sizes 4 64 256 1024 --measure_s 30
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from node.transport.protobuf_shim import import_hivemind_isolated  # noqa: E402

import_hivemind_isolated()

from benchmarks.lab.presets import TINY_MODEL  # noqa: E402

from node.config import NodeConfig, load_config  # noqa: E402
from node.tasks import materialize  # noqa: E402
from node.transport.joining import key_prefix, shutdown_dht  # noqa: E402
from node.transport.records import RecordWriter, SwarmRecordValidator, bound_key_storage  # noqa: E402
from protocol import NodeIdentity, PeerStats, RolloutBatch, RolloutCompletion, RolloutQuestion, TaskSpec  # noqa: E402
from protocol.shards import (  # noqa: E402
    HEARTBEAT_SHARDS,
    peers_key,
    rollout_key,
    rollout_shard_count,
    rollout_write_levels,
    shard_of,
)
from protocol.version import PROTOCOL_VERSION  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
QUESTIONS_PER_BATCH = 2  # as a node with swarm.local_questions=2 publishes
COMPLETIONS_PER_QUESTION = 4
TOKENS_PER_COMPLETION = 32  # token ids and log-probs travel with each completion, as a node's do


class Crowd:
    """M identities publishing valid signed heartbeats and rollout batches through one DHT peer."""

    def __init__(self, config: NodeConfig, seed: int = 0) -> None:
        self.config = config
        self.prefix = key_prefix(config.swarm.swarm_id)
        self.members: list[RecordWriter] = []
        self.dht = None
        self.addresses: list[str] = []
        self.seed = seed
        self.rounds = 0

    async def start(self, host: str = "127.0.0.1") -> list[str]:
        """Start the crowd's DHT peer (a server that stores records, validating them as nodes do); returns its
        addresses."""
        from hivemind.dht.node import DHTNode

        from node.transport.reachability import serve_observed_address

        self.dht = await DHTNode.create(
            host_maddrs=[f"/ip4/{host}/tcp/0"], record_validator=SwarmRecordValidator(self.config.swarm.swarm_id)
        )
        bound_key_storage(self.dht)  # stores what a node's DHT would, no more
        # a joining node measures its reachability against its bootstrap peer
        await serve_observed_address(self.dht.p2p)
        self.addresses = [str(a) for a in await self.dht.get_visible_maddrs()]
        return self.addresses

    def grow(self, size: int) -> None:
        """Add identities until the crowd has `size` members."""
        while len(self.members) < size:
            self.members.append(RecordWriter(NodeIdentity.generate(), self.config.swarm.swarm_id))

    def heartbeat(self, member: RecordWriter, now: float) -> PeerStats:
        return PeerStats(
            node_id=member.identity.node_id,
            display_name=f"crowd-{self.members.index(member)}",
            software_version="crowd",
            protocol_version=PROTOCOL_VERSION,
            model_name="crowd",
            model_parameters=1,
            round=self.rounds,
            policy_version=self.rounds,
            reward_mean=0.5,
            accuracy=0.5,
            rollouts_published=self.rounds,
            rollouts_received=0,
            rollouts_accepted=0,
            rollouts_rejected=0,
            tokens_per_s=0.0,
            uptime_s=0.0,
            last_seen=now,
            addresses=[],
            gossip_addresses=[],
            outer_steps=0,
            outer_steps_skipped=0,
            reachability="direct",
        )

    def batch(self, member_index: int) -> RolloutBatch:
        """Questions of the node's task mix, each with one right answer among wrong ones (a learning signal, claimed
        honestly)."""
        mixes = self.config.tasks.datasets
        questions = []
        for q in range(QUESTIONS_PER_BATCH):
            mix = mixes[(member_index + q) % len(mixes)]
            spec = TaskSpec(
                mix.name, mix.config, seed=self.seed + self.rounds, index=member_index * QUESTIONS_PER_BATCH + q
            )
            answer = materialize(spec).answer
            texts = [answer] + [f"{answer}{k}" for k in range(1, COMPLETIONS_PER_QUESTION)]
            completions = [
                RolloutCompletion(
                    text=text,
                    token_ids=list(range(1, TOKENS_PER_COMPLETION + 1)),
                    logprobs=[-1.0] * TOKENS_PER_COMPLETION,
                    finish_reason="stop",
                )
                for text in texts
            ]
            questions.append(
                RolloutQuestion(
                    spec=spec, completions=completions, claimed_rewards=[1.0] + [0.0] * (COMPLETIONS_PER_QUESTION - 1)
                )
            )
        return RolloutBatch(
            round=self.rounds, policy_version=self.rounds, model_fingerprint="crowd", questions=questions
        )

    async def publish(self, timeout: float = 120.0) -> tuple[int, int]:
        """Every member publishes a heartbeat and a batch for the current window, at the shard levels a real node of
        this swarm size would (its own estimate: the crowd's size and the real node). Returns (records stored,
        refused)."""
        self.rounds += 1
        now = time.time()
        window = int(now // self.config.swarm.window_s)
        levels = rollout_write_levels(rollout_shard_count(len(self.members) + 1))
        keys, subkeys, values, expirations = [], [], [], []

        def add(key: str, member: RecordWriter, record) -> None:
            keys.append(key)
            subkeys.append(member.identity.node_id)
            values.append(record.data)
            expirations.append(record.expiration)

        for index, member in enumerate(self.members):
            node_id = member.identity.node_id
            add(
                peers_key(self.prefix, shard_of(node_id, HEARTBEAT_SHARDS)),
                member,
                member.sign(self.heartbeat(member, now)),
            )
            record = member.sign(self.batch(index))
            for level in levels:
                add(rollout_key(self.prefix, window, level, shard_of(node_id, level)), member, record)
        if not keys:
            return 0, 0
        stored = await asyncio.wait_for(self.dht.store_many(keys, values, expirations, subkeys=subkeys), timeout)
        accepted = sum(bool(ok) for ok in stored.values())
        return accepted, len(stored) - accepted

    async def flood(self, key: str, identities: list[NodeIdentity]) -> int:
        """Store one valid batch per identity under `key` (whatever shard it belongs to); returns how many the DHT
        took."""
        writers = [RecordWriter(identity, self.config.swarm.swarm_id) for identity in identities]
        records = [writer.sign(self.batch(i)) for i, writer in enumerate(writers)]
        stored = await self.dht.store_many(
            [key] * len(writers),
            [r.data for r in records],
            [r.expiration for r in records],
            subkeys=[w.identity.node_id for w in writers],
        )
        return sum(bool(ok) for ok in stored.values())

    async def stop(self) -> None:
        if self.dht is not None:
            await shutdown_dht(self.dht)
            self.dht = None


# --- the benchmark ------------------------------------------------------------------------------

# the tests' tiny model, so that rounds are short and the swarm's share shows
NODE_OVERRIDES = [
    *TINY_MODEL,
    "rollout.completions_per_question=4",
    "rollout.max_new_tokens=16",
    "tasks.heldout_size=8",
    "tasks.format_reward=0.1",
    "swarm.transport=dht",
    'swarm.host_maddrs=["/ip4/127.0.0.1/tcp/0"]',
    "swarm.local_questions=2",
    "swarm.external_questions=2",
    "swarm.gossip=dht",
    "swarm.client_mode=true",
    "swarm.reachability=direct",
    "swarm.heartbeat_interval_s=2",
    "swarm.heartbeat_ttl_s=60",
    "swarm.swarm_id=crowd-bench",
    "checkpoint_keep=1",
    "checkpoint_every=1000",
    "eval_every=0",
]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def read_rows(state_dir: Path) -> list[dict]:
    path = state_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def read_totals(state_dir: Path) -> dict:
    try:
        return json.loads((state_dir / "swarm.json").read_text())["totals"]
    except (OSError, ValueError, KeyError):
        return {}


async def wait_until(predicate, timeout: float, what: str, interval: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        await asyncio.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")


async def list_peers(address: str, swarm_id: str) -> tuple[float, int]:
    """(seconds, peers listed) of `swarm-node peers --json`, as a user runs it."""
    started = time.monotonic()
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "node.cli",
        "peers",
        "--initial-peers",
        address,
        "--swarm-id",
        swarm_id,
        "--json",
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    try:
        out, err = await asyncio.wait_for(process.communicate(), 300)
    except asyncio.TimeoutError:
        # this one process, by its handle: it started no children of its own but p2pd, which dies with it
        process.kill()
        await process.wait()
        raise
    if process.returncode != 0:
        raise RuntimeError(f"swarm-node peers failed: {err.decode()[-2000:]}")
    return time.monotonic() - started, len(json.loads(out.decode().strip().splitlines()[-1]))


async def run(args) -> dict:
    scratch = Path(tempfile.mkdtemp(prefix="crowd-"))
    config = load_config(
        REPO / "configs" / "swarm.yaml",
        [*NODE_OVERRIDES, f"swarm.window_s={args.window_s}"],
        state_dir=str(scratch / "node"),
    )
    crowd = Crowd(config)
    address = (await crowd.start())[0]
    state_dir = scratch / "node"
    node = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "node.cli",
            "join",
            "--config",
            str(REPO / "configs" / "swarm.yaml"),
            "--state-dir",
            str(state_dir),
            "--initial-peers",
            address,
            *[a for o in NODE_OVERRIDES + [f"swarm.window_s={args.window_s}"] for a in ("--set", o)],
        ],
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        stdout=open(scratch / "node.out", "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    results: dict[str, dict] = {}
    try:
        await wait_until(
            lambda: node.poll() is None and len(read_rows(state_dir)) >= args.warmup, 300, "the node's first rounds"
        )
        for size in [0, *args.sizes]:
            crowd.grow(size)
            await crowd.publish()
            # the node's heartbeat loop re-estimates the size every beat; two beats and a round later it reads at the
            # new shard count
            await asyncio.sleep(2 * 2.0 + 1.0)
            first_row, totals_before, started = len(read_rows(state_dir)), read_totals(state_dir), time.monotonic()
            published_at, publish_s = time.monotonic(), []
            while time.monotonic() - started < args.measure_s:
                if node.poll() is not None:
                    raise RuntimeError(f"the node exited ({node.returncode}); see {scratch / 'node.out'}")
                if time.monotonic() - published_at >= args.window_s:  # each member publishes once a window
                    published_at = time.monotonic()
                    await crowd.publish()
                    publish_s.append(time.monotonic() - published_at)
                await asyncio.sleep(0.2)
            rows = read_rows(state_dir)[first_row:]
            totals = read_totals(state_dir)
            rounds = len(rows)
            peers_s, peers_listed = await list_peers(address, config.swarm.swarm_id)
            delta = lambda name: (totals.get(name, 0) - totals_before.get(name, 0)) / rounds  # noqa: E731
            results[str(size)] = {
                "round_s": statistics.median(r["step_s"] for r in rows),
                "bytes_per_round": delta("bytes_read"),
                "values_per_round": delta("values_read"),
                "decoded_per_round": delta("values_decoded"),
                "rounds": rounds,
                "round_s_mean": statistics.mean(r["step_s"] for r in rows),
                "rescored_per_round": statistics.mean(r.get("external_rescored", 0) for r in rows),
                "rescored_max": max(r.get("external_rescored", 0) for r in rows),
                "crowd_publish_s": statistics.mean(publish_s) if publish_s else None,
                "external_per_round": statistics.mean(r.get("external_questions", 0) for r in rows),
                "rss_mib": rss_mib(node.pid),
                "peers_s": peers_s,
                "peers_listed": peers_listed,
                "swarm_size_estimate": totals.get("swarm_size_estimate"),
                "reads_failed": totals.get("rollout_reads_failed", 0) - totals_before.get("rollout_reads_failed", 0),
            }
            print(json.dumps({"size": size, **results[str(size)]}), flush=True)
    finally:
        if node.poll() is None:
            os.killpg(node.pid, signal.SIGINT)
            try:
                node.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(node.pid, signal.SIGKILL)
                node.wait()
        await crowd.stop()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--sizes",
        type=int,
        nargs="+",
        default=[4, 64, 256, 1024],
        help="crowd sizes M, measured in this order (the crowd only grows)",
    )
    parser.add_argument(
        "--measure_s",
        type=float,
        default=30.0,
        help="seconds of rounds measured per size (the crowd publishes once a window meanwhile)",
    )
    parser.add_argument("--warmup", type=int, default=3, help="rounds the node runs before the first measurement")
    parser.add_argument(
        "--window_s", type=float, default=10.0, help="swarm.window_s: the crowd publishes once a window"
    )
    args = parser.parse_args()
    results = asyncio.run(run(args))
    sizes = args.sizes
    print(
        json.dumps(
            {
                "benchmark": "crowd",
                "sizes": sizes,
                "alone_round_s": results["0"]["round_s"],
                "round_s_by_size": [results[str(m)]["round_s"] for m in sizes],
                "bytes_per_round_by_size": [results[str(m)]["bytes_per_round"] for m in sizes],
                "values_per_round_by_size": [results[str(m)]["values_per_round"] for m in sizes],
                "rescored_per_round_by_size": [results[str(m)]["rescored_per_round"] for m in sizes],
                "rescored_max_by_size": [results[str(m)]["rescored_max"] for m in sizes],
                "rss_mib_by_size": [results[str(m)]["rss_mib"] for m in sizes],
                "peers_listed_by_size": [results[str(m)]["peers_listed"] for m in sizes],
                "peers_s_by_size": [results[str(m)]["peers_s"] for m in sizes],
            }
        )
    )


if __name__ == "__main__":
    main()
