"""What the lab's runs and the tests start their nodes with: the tiny models that keep a round short, the pipeline's
timings that keep a healing run short, and a `swarm-node` command line for a node listening on its lab address.

One place for them, so that a benchmark (the soak, the crowd) and the tests that check the same behaviour run the same
model under the same timings, and the tests import it from here (benchmarks never import tests).
"""

from __future__ import annotations

import sys
from pathlib import Path

# A character-level model small enough that a round takes a fraction of a second on one loaded core.
TINY_MODEL = [
    "model.default.hidden_size=32",
    "model.default.num_layers=2",
    "model.default.num_heads=2",
    "model.default.intermediate_size=64",
    "model.default.max_position_embeddings=128",
    "model.default.warmup_steps=5",
    "model.default.warmup_batch_size=8",
]

# A pipeline run of the tiny model (its stages are its layers: `model.default.num_layers=` and `pipeline.num_stages=`
# are each run's own) and the timings under which a lost stage is found and healed within seconds.
PIPELINE_TIMINGS = [
    "model.default.hidden_size=32",
    "model.default.num_heads=2",
    "model.default.intermediate_size=64",
    "model.default.max_position_embeddings=128",
    "model.default.warmup_steps=0",
    "swarm.bootstrap_backoff_s=0.5",
    "pipeline.micro_batch_size=4",
    "pipeline.micro_batches=2",
    "pipeline.sequence_length=32",
    "pipeline.corpus_sequences=64",
    "pipeline.validation_sequences=8",
    "pipeline.eval_every=0",
    "pipeline.announce_interval_s=0.5",
    # generous: a server starved by a neighbour's start must not look dead; a killed one is reported by the driver
    "pipeline.announce_ttl_s=10",
    "pipeline.avoid_s=6",
    "pipeline.replica_sync_every=1",
    "pipeline.rebalance_grace_s=3",
    # throughput moves (unit-tested) only for a 5x gain: a loaded machine's samples/s is noisy
    "pipeline.balance_quality=0.2",
    "torch_threads=1",
]


def lab_command(
    command: str,
    state_dir: Path,
    ip: str,
    name: str,
    *,
    config: Path | None = None,
    port: int = 0,
    extra: list[str] = (),
    peers: list[str] = (),
) -> list[str]:
    """`swarm-node COMMAND` with its state in `state_dir`, listening on `ip` (port 0: any), named `name`, `extra`
    arguments after those and `--initial-peers` last where there are any."""
    argv = [sys.executable, "-m", "node.cli", command]
    if config is not None:
        argv += ["--config", str(config)]
    argv += [
        "--state-dir",
        str(state_dir),
        "--set",
        f'swarm.host_maddrs=["/ip4/{ip}/tcp/{port}"]',
        "--set",
        f"name={name}",
        *extra,
    ]
    return argv + (["--initial-peers", *peers] if peers else [])
