"""Remake docs/dashboard.png: a swarm of specialists that learn from each other, node 0's dashboard as headless
Chromium renders it, from a real run.

`swarm-node simulate --nodes 4 --config configs/specialists.yaml`, nodes 0-1 warm-started on subtraction and nodes 2-3
on addition (`--node-set`, the warm starts of benchmarks/sharing.py), held-out accuracy per specialty every 25 rounds:
node 0's "heldout by dataset" chart shows the specialty it lacked (addition) rise as its peers teach it, and the peers
table each node's accuracy per specialty.

    .venv/bin/python docs/dashboard_screenshot.py [--minutes 15] [--out docs/dashboard.png]

Needs Debian's `chromium` (`make install` installs it). The swarm runs in a scratch folder with
its own model cache, so the picture starts from a fresh warm start, and is stopped with Ctrl-C
(each node saves and exits) once the picture is taken.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The page polls its JSON API; this much virtual time lets it fetch and draw every chart.
RENDER_BUDGET_MS = 10000
# Wide enough for the peers table's last column and the right-hand charts (1280 cuts them).
WINDOW = "1600,1400"


EVAL_EVERY = 25
# (specialty, warm-start steps) of nodes 0-3: the steps that bring either specialist to about half right on its own
# specialty (benchmarks/sharing.py --warmup-steps add=125 subtract=230). Node 0, whose dashboard is pictured, knows
# subtraction: the subtraction specialists are the ones that learn the other specialty fastest
# (benchmarks/notebook/2026-11-28-sharing-compute-units.md).
SPECIALISTS = [("subtract", 230), ("subtract", 230), ("add", 125), ("add", 125)]


def node_sets(node: int, specialty: str, steps: int) -> list[str]:
    return [
        "--node-set",
        f'{node}:model.default.warmup_labels=["{specialty}"]',
        "--node-set",
        f"{node}:model.default.warmup_steps={steps}",
    ]


def last_rounds(swarm_root: Path) -> str:
    """Each node's last round so far, from its metrics.jsonl: the progress line."""
    rounds = []
    for i in range(len(SPECIALISTS)):
        metrics = swarm_root / f"node-{i}" / "metrics.jsonl"
        lines = metrics.read_text().splitlines() if metrics.exists() else []
        rounds.append(json.loads(lines[-1])["round"] if lines and lines[-1].endswith("}") else 0)
    return "rounds " + " ".join(f"node-{i} {r}" for i, r in enumerate(rounds))


def chromium() -> str:
    binary = os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if binary is None:
        sys.exit(
            "no chromium on PATH: `make install` installs it (apt-get install chromium), or set "
            "CHROMIUM=/path/to/chromium"
        )
    return binary


def wait_for_file(path: Path, swarm: subprocess.Popen, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if swarm.poll() is not None:
            sys.exit(f"simulate exited with {swarm.returncode} before {path} appeared")
        if path.exists() and path.read_text().strip():
            return path.read_text().strip()
        time.sleep(1)
    sys.exit(f"{path} did not appear within {timeout_s:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--minutes", type=float, default=15, help="how long the swarm learns before the picture (default: 15)"
    )
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "dashboard.png")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="swarm-node-dashboard-") as scratch:
        root = Path(scratch)
        env = dict(os.environ, SWARM_NODE_CACHE=str(root / "cache"), PYTHONUNBUFFERED="1")
        log = open(root / "simulate.out", "w")
        # Its own process group: Ctrl-C reaches simulate, which passes it to each node's group.
        swarm = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "node.cli",
                "simulate",
                "--nodes",
                "4",
                "--state-dir",
                str(root / "swarm"),
                "--dashboard-port",
                "0",
                "--config",
                str(REPO / "configs" / "specialists.yaml"),
                "--set",
                f"eval_every={EVAL_EVERY}",
                *(option for i, setting in enumerate(SPECIALISTS) for option in node_sets(i, *setting)),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=REPO,
            start_new_session=True,
        )
        try:
            # Node 0 first builds the default model (minutes on a busy machine), then serves its dashboard.
            url = wait_for_file(root / "swarm" / "node-0" / "dashboard.txt", swarm, 1800)
            print(f"dashboard at {url}; the swarm learns for {args.minutes:g} minutes", flush=True)
            ends = time.monotonic() + args.minutes * 60
            while (left := ends - time.monotonic()) > 0:
                time.sleep(min(60.0, left))
                to_go = max(0.0, ends - time.monotonic()) / 60
                print(f"  {last_rounds(root / 'swarm')}, {to_go:.0f} min to go", flush=True)
            if swarm.poll() is not None:
                sys.exit(f"simulate exited with {swarm.returncode}: see {root / 'simulate.out'}")
            subprocess.run(
                [
                    chromium(),
                    "--headless",
                    "--no-sandbox",
                    "--disable-gpu",
                    "--disable-dev-shm-usage",
                    "--no-first-run",
                    f"--user-data-dir={root / 'chromium-profile'}",
                    "--hide-scrollbars",
                    f"--window-size={WINDOW}",
                    f"--virtual-time-budget={RENDER_BUDGET_MS}",
                    f"--screenshot={args.out.resolve()}",
                    url,
                ],
                check=True,
                capture_output=True,
                timeout=300,
            )
            print(f"wrote {args.out}")
        finally:
            if swarm.poll() is None:
                os.killpg(swarm.pid, signal.SIGINT)
                try:
                    swarm.wait(timeout=300)
                except subprocess.TimeoutExpired:
                    os.killpg(swarm.pid, signal.SIGKILL)
                    swarm.wait()
            log.close()


if __name__ == "__main__":
    main()
