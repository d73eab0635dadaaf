"""A mixed pair across two hosts: a SmolLM2-135M-Instruct node and a default-model node in one swarm.

Two network namespaces of benchmarks/lab/, each link shaped to --mbit both ways: node 0 runs
`swarm-node join --config configs/smollm2_swarm.yaml` (49,152-token BPE vocabulary, chat prompts,
final-number grading), node 1 `swarm-node join` on the embedded default model (a 100-symbol character
vocabulary, its own template) given node 0's address. Both share one swarm and its add_sub_1d
questions. After --minutes, `swarm-node peers --json` runs in node 1's namespace and the two nodes
are stopped. Reported per node: rounds, peers' questions trained on (metrics.jsonl
`external_questions`), what its heartbeat says in `peers --json` (rollouts received and accepted,
model), and what its metrics say of the peer's groups. Each re-tokenizes and re-scores the other's
text: another vocabulary's log-probs are never kept (tests/test_pretrained.py checks that on the
records themselves). Needs root (ip netns). Ends with one JSON line.

    sudo .venv/bin/python benchmarks/mixed_pair.py --minutes 10 --results benchmarks/results/mixed_pair.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.lab import Lab, Link, lab_unavailable  # noqa: E402
from benchmarks.common import print_result_line, read_json_lines  # noqa: E402

SWARM_NODE = str(REPO / ".venv" / "bin" / "swarm-node")


def settings(values: list[str]) -> list[str]:
    return [arg for value in values for arg in ("--set", value)]


def wait_for_address(path: Path, ip: str, proc: subprocess.Popen, timeout_s: float = 900.0) -> str:
    """The multiaddr node 0 announces on its lab address, once it has written it (SmolLM2 loads first)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"node 0 exited with {proc.returncode} before announcing an address")
        if path.exists():
            found = [line for line in path.read_text().split() if f"/ip4/{ip}/" in line]
            if found:
                return found[0]
        time.sleep(2)
    raise SystemExit(f"node 0 announced no /ip4/{ip} address in {timeout_s:.0f} s")


def metrics_summary(state_dir: Path) -> dict:
    rows = read_json_lines(state_dir / "metrics.jsonl")
    return {
        "rounds": len(rows),
        "external_questions": sum(r.get("external_questions", 0) for r in rows),
        "rounds_with_external": sum(1 for r in rows if r.get("external_questions", 0)),
        "reward_mean_last": rows[-1].get("reward_mean") if rows else None,
    }


def refusals(scratch: Path) -> dict[str, dict[str, int]]:
    """Per node, how many of the peer's questions it refused, by reason (its node.log)."""
    counts: dict[str, dict[str, int]] = {}
    for name in ("smollm2", "default"):
        log = scratch / name / "node.log"
        lines = log.read_text().splitlines() if log.exists() else []
        for line in lines:
            if "refused a question from" in line:
                reason = line.split(": ")[-2].split()[-1] if line.count(": ") >= 2 else "?"
                counts.setdefault(name, {}).setdefault(reason, 0)
                counts[name][reason] += 1
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0, help="how long the pair trains once both are up")
    parser.add_argument("--mbit", type=float, default=100.0, help="each node's link rate, each way")
    parser.add_argument(
        "--default-set",
        action="append",
        default=[],
        help="config overrides of the default-model node (e.g. tasks.answer_extraction=final_number: it then reads "
        "SmolLM2's '7 + 5 = 12' as 12, as SmolLM2's node does, and its own '12' the same as before)",
    )
    parser.add_argument("--results", type=Path, default=None, help="also append the JSON line here")
    args = parser.parse_args()
    why = lab_unavailable()
    if why:
        raise SystemExit(f"mixed_pair needs the namespaced lab: {why}")
    scratch = Path(tempfile.mkdtemp(prefix="mixed-pair-"))
    with Lab(2, host_link=False) as lab:
        for index in range(2):
            lab.shape(index, Link(mbit=args.mbit))
        common = [f"swarm.swarm_id=mixed-{lab.tag}", "torch_threads=1", "eval_every=0", "checkpoint_every=1000"]

        def listen(index: int) -> list[str]:
            return settings([*common, "swarm.host_maddrs=" + json.dumps([f"/ip4/{lab.ip(index)}/tcp/0"])])

        smol = [SWARM_NODE, "join", "--config", "configs/smollm2_swarm.yaml", "--state-dir", str(scratch / "smollm2")]
        smol_proc = lab.run(0, [*smol, "--fresh", *listen(0)], scratch / "smollm2.out")
        address = wait_for_address(scratch / "smollm2" / "addresses.txt", lab.ip(0), smol_proc)
        # the default node's own preset gates peers' groups to stronger peers; this pair measures the exchange
        default = [SWARM_NODE, "join", "--state-dir", str(scratch / "default"), "--initial-peers", address]
        default_settings = settings(["swarm.external_gate=none", *args.default_set])
        lab.run(1, [*default, "--fresh", *listen(1), *default_settings], scratch / "default.out")
        started = time.monotonic()
        while time.monotonic() - started < args.minutes * 60:
            time.sleep(15)
            for index, name in enumerate(("smollm2", "default")):
                if not lab.alive(index):
                    raise SystemExit(f"node {name} died; see {scratch / (name + '.out')}")
            now = {name: metrics_summary(scratch / name) for name in ("smollm2", "default")}
            said = [f"{n} rounds {s['rounds']} peers' questions {s['external_questions']}" for n, s in now.items()]
            print(f"{(time.monotonic() - started) / 60:5.1f} min: " + ", ".join(said), flush=True)
        peers_log = scratch / "peers.json"
        watcher = [SWARM_NODE, "peers", "--json", "--swarm-id", f"mixed-{lab.tag}", "--initial-peers", address]
        # beside node 1 in its namespace, not through lab.run, which would take node 1's place in the lab's records
        # (and leave the node itself running when the lab goes down)
        with open(peers_log, "w") as out:
            in_node_1 = ["ip", "netns", "exec", lab.ns(1), *watcher]
            subprocess.run(in_node_1, stdout=out, stderr=subprocess.STDOUT, timeout=300, check=False)
        heartbeats = json.loads(peers_log.read_text().strip().splitlines()[-1])
        for index in range(2):
            lab.kill(index, signal.SIGINT)
    result = {}
    for name in ("smollm2", "default"):
        row = next((r for r in heartbeats if ("smollm2" in r["model_name"].lower()) == (name == "smollm2")), {})
        result[name] = {
            **metrics_summary(scratch / name),
            "peers_json": {
                key: row.get(key)
                for key in ("model_name", "model_parameters", "round", "rollouts_received", "rollouts_accepted")
            },
        }
        print(f"{name}: {result[name]}")
    line = {
        "benchmark": "mixed_pair",
        "date": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()),
        "minutes": args.minutes,
        "mbit": args.mbit,
        "default_overrides": args.default_set,
        "nodes": result,
        "refusals": refusals(scratch),
        "heartbeats_seen": len(heartbeats),
        "both_trained_on_the_other": all(r["external_questions"] > 0 for r in result.values()),
        "load_average": os.getloadavg(),
        "logs": str(scratch),
    }
    print_result_line(line, args.results)


if __name__ == "__main__":
    main()
