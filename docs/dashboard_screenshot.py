"""Remake docs/dashboard.png: `swarm-node simulate --nodes 4` on the default model, node 0's
dashboard after a few minutes of learning, as headless Chromium renders it.

    .venv/bin/python docs/dashboard_screenshot.py [--minutes 6] [--out docs/dashboard.png]

Needs Debian's `chromium` (`make install` installs it). The swarm runs in a scratch folder with
its own model cache, so the picture starts from a fresh warm start, and is stopped with Ctrl-C
(each node saves and exits) once the picture is taken.
"""

from __future__ import annotations

import argparse
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
        "--minutes", type=float, default=6, help="how long the swarm learns before the picture (default: 6)"
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
            time.sleep(args.minutes * 60)
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
