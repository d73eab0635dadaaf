"""A swarm in the lab: `swarm-node join` nodes started in their namespaces, and what their state directories say
(rounds, rounds per minute, seconds by phase, peers' questions used, gossip received)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.lab.network import REPO, Lab
from benchmarks.lab.presets import lab_command


def node_argv(lab: Lab, index: int, state_dir: Path, bootstrap: str | None, sets: list[str], fresh: bool) -> list[str]:
    extra = [argument for item in sets for argument in ("--set", item)] + (["--fresh"] if fresh else [])
    return lab_command(
        "join", state_dir, lab.ip(index), f"lab-{index}", extra=extra, peers=[bootstrap] if bootstrap else []
    )


def wait_for_address(state_dir: Path, ip: str, timeout_s: float, proc: subprocess.Popen) -> str:
    """The multiaddr on `ip` a started node wrote to addresses.txt (it is listening then)."""
    deadline = time.monotonic() + timeout_s
    path = state_dir / "addresses.txt"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the node exited with {proc.returncode} before listening; see {state_dir}")
        if path.exists():
            for line in path.read_text().split():
                if f"/ip4/{ip}/" in line:
                    return line
        time.sleep(0.5)
    raise RuntimeError(f"no address on {ip} in {path} after {timeout_s:.0f}s")


def start_swarm(
    lab: Lab,
    root: Path,
    sets: list[str],
    env: dict[str, str] | None = None,
    start_timeout_s: float = 1800,
    swarm_nodes: int | None = None,
) -> str:
    """Node 0 first, then every other node (of the first swarm_nodes, default all) joining it at its lab address; node
    0's address."""
    state0 = root / "n0"
    lab.run(0, node_argv(lab, 0, state0, None, sets, fresh=True), root / "n0.out", env)
    bootstrap = wait_for_address(state0, lab.ip(0), start_timeout_s, lab.processes[0].popen)
    for index in range(1, lab.nodes if swarm_nodes is None else swarm_nodes):
        lab.run(
            index, node_argv(lab, index, root / f"n{index}", bootstrap, sets, fresh=True), root / f"n{index}.out", env
        )
    return bootstrap


def isolated_argv(lab: Lab, index: int, state_dir: Path, sets: list[str]) -> list[str]:
    """The swarm's own config with no network at all (`train`), all 8 questions of a round local
    (SAPO's 8/0): the baseline of what the swarm costs in throughput."""
    argv = [
        sys.executable,
        "-m",
        "node.cli",
        "train",
        "--config",
        str(REPO / "configs" / "swarm.yaml"),
        "--state-dir",
        str(state_dir),
        "--set",
        f"name=lab-{index}",
        "--fresh",
    ]
    for item in [*sets, "swarm.transport=none", "swarm.local_questions=8", "swarm.external_questions=0"]:
        argv += ["--set", item]
    return argv


PHASES = ("generation_s", "scoring_s", "update_s")


def steady_rows(rows: list[dict], skip_s: float = 60.0) -> list[dict]:
    """Metrics rows after the first skip_s seconds of training (start-up and warm caches left out)."""
    timed = [r for r in rows if "round" in r and "time" in r]
    if not timed:
        return []
    return [r for r in timed if r["time"] >= timed[0]["time"] + skip_s] or timed


def rounds_per_minute(rows: list[dict], skip_s: float = 60.0) -> float | None:
    steady = steady_rows(rows, skip_s)
    if len(steady) < 2 or steady[-1]["time"] <= steady[0]["time"]:
        return None
    return (steady[-1]["round"] - steady[0]["round"]) / ((steady[-1]["time"] - steady[0]["time"]) / 60)


def seconds_by_phase(rows: list[dict], skip_s: float = 60.0) -> dict[str, float] | None:
    """Mean seconds per round in generation, scoring and update, and in everything else
    (`other_s`: publishing, collecting and re-scoring peers' rollouts, evaluation, checkpoints)."""
    steady = [r for r in steady_rows(rows, skip_s) if "step_s" in r and all(k in r for k in PHASES)]
    if not steady:
        return None
    means = {k: sum(r[k] for r in steady) / len(steady) for k in (*PHASES, "step_s")}
    means["other_s"] = means["step_s"] - sum(means[k] for k in PHASES)
    return means


def node_summary(state_dir: Path) -> dict:
    rows = []
    metrics = state_dir / "metrics.jsonl"
    if metrics.exists():
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.endswith("}")]
    swarm = json.loads((state_dir / "swarm.json").read_text()) if (state_dir / "swarm.json").exists() else {}
    totals = swarm.get("totals", {})
    return {
        "rounds": rows[-1]["round"] if rows else 0,
        "rounds_per_min": rounds_per_minute(rows),
        "seconds_by_phase": seconds_by_phase(rows),
        "external_questions": sum(r.get("external_questions", 0) for r in rows),
        "gossip_messages_received": totals.get("gossip_messages_received", 0),
        "batches_accepted": totals.get("batches_accepted", 0),
    }
