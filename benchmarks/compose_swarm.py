"""What `docker-compose up` gives: the image's size and build time, the time from `up` to three peers on the
dashboard, and each node's rounds per minute in its container against the same three nodes as plain processes
(`swarm-node simulate --nodes 3`: `join` on the same defaults, one torch thread each, a fresh model cache each side),
run side by side at the same time so that both share the machine's load.

    .venv/bin/python benchmarks/compose_swarm.py [--minutes 5]

Root, and Debian's docker.io, docker-compose and debootstrap (installed with apt where missing). It starts a dockerd
of its own (tests/helpers/docker_engine.py: own socket and data root; the host's iptables, ip_forward and links put
back when it stops), builds the image as tests/test_compose_up.py does, and removes the project (`down -v`) at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.helpers.compose import (  # noqa: E402
    SERVICES,
    Project,
    build_image,
    image_size,
    peers_on_dashboard,
)
from tests.helpers.docker_engine import DockerEngine  # noqa: E402
from tests.helpers.images import install_missing  # noqa: E402

START_TIMEOUT_S = 1200  # the default model is built on each side before its node 0 serves the dashboard
POLL_S = 2.0


def cpu_seconds(root_pid: int) -> float:
    """User and system CPU seconds of a process and its descendants so far (a node and its p2p daemon)."""
    try:
        root = psutil.Process(root_pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for process in processes:
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def last_round(state: Path) -> int:
    metrics = state / "metrics.jsonl"
    lines = metrics.read_text().splitlines() if metrics.exists() else []
    return json.loads(lines[-1])["round"] if lines and lines[-1].endswith("}") else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=5.0, help="the window rounds are counted over (default: 5)")
    args = parser.parse_args()
    missing = install_missing(
        {"dockerd": "docker.io", "docker-compose": "docker-compose", "debootstrap": "debootstrap"}
    )
    if missing:
        sys.exit(missing)

    with tempfile.TemporaryDirectory(prefix="swarm-node-compose-bench-") as scratch:
        root = Path(scratch)
        engine = DockerEngine(root / "dockerd.log")
        project = None
        plain = None
        try:
            engine.start()
            build_s = build_image(engine, root / "wheels")
            size = image_size(engine)
            print(f"image: {size / 2**20:.0f} MiB, built in {build_s:.0f} s (cached layers reused where unchanged)")

            project = Project(engine)
            env = dict(os.environ, SWARM_NODE_CACHE=str(root / "plain-cache"), PYTHONUNBUFFERED="1")
            started = time.monotonic()
            project.compose("up", "--detach", "--no-build")
            log = open(root / "simulate.out", "w")
            plain = subprocess.Popen(
                [sys.executable, "-m", "node.cli", "simulate", "--nodes", "3", "--state-dir", str(root / "plain")]
                + ["--dashboard-port", "0"],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
            plain_dashboard = root / "plain" / "node-0" / "dashboard.txt"
            to_three: dict[str, float] = {}
            while len(to_three) < 2:
                if time.monotonic() - started > START_TIMEOUT_S:
                    sys.exit(f"not three peers on both dashboards within {START_TIMEOUT_S} s: {to_three}")
                if plain.poll() is not None:
                    sys.exit(f"simulate exited with {plain.returncode}: {(root / 'simulate.out').read_text()[-2000:]}")
                project.assert_running()
                if "containers" not in to_three and len(peers_on_dashboard()) == 3:
                    to_three["containers"] = time.monotonic() - started
                    print(f"containers: three peers on the dashboard after {to_three['containers']:.0f} s", flush=True)
                url = plain_dashboard.read_text().strip() if plain_dashboard.exists() else ""
                if "processes" not in to_three and url and len(peers_on_dashboard(url)) == 3:
                    to_three["processes"] = time.monotonic() - started
                    print(f"processes: three peers on the dashboard after {to_three['processes']:.0f} s", flush=True)
                time.sleep(POLL_S)

            states = {
                "containers": [project.state(service) for service in SERVICES],
                "processes": [root / "plain" / f"node-{i}" for i in range(3)],
            }
            # the nodes' processes as this host sees them: a container's main process is its node (its command execs it)
            node_pids = {
                "containers": [project.container(service)["State"]["Pid"] for service in SERVICES],
                "processes": [child.pid for child in psutil.Process(plain.pid).children() if "join" in child.cmdline()],
            }
            assert len(node_pids["processes"]) == 3, node_pids
            first = {side: [last_round(state) for state in paths] for side, paths in states.items()}
            cpu_first = {side: [cpu_seconds(pid) for pid in pids] for side, pids in node_pids.items()}
            window_started = time.monotonic()
            while time.monotonic() - window_started < args.minutes * 60:
                time.sleep(min(60.0, args.minutes * 60 - (time.monotonic() - window_started)))
                project.assert_running()
                print(
                    "  rounds so far: "
                    + ", ".join(f"{side} {[last_round(s) for s in paths]}" for side, paths in states.items()),
                    flush=True,
                )
            minutes = (time.monotonic() - window_started) / 60
            rounds_done = {
                side: [last_round(state) - r0 for state, r0 in zip(paths, first[side])]
                for side, paths in states.items()
            }
            per_minute = {side: [r / minutes for r in done] for side, done in rounds_done.items()}
            # CPU seconds a round: what a round costs, whatever share of the cores the scheduler gave each side
            cpu_per_round = {
                side: [
                    (cpu_seconds(pid) - c0) / max(1, r)
                    for pid, c0, r in zip(node_pids[side], cpu_first[side], rounds_done[side])
                ]
                for side in node_pids
            }
        finally:
            if plain is not None and plain.poll() is None:
                os.killpg(plain.pid, signal.SIGINT)
                try:
                    plain.wait(timeout=300)
                except subprocess.TimeoutExpired:
                    os.killpg(plain.pid, signal.SIGKILL)
                    plain.wait()
            if project is not None:
                project.compose("down", "--volumes", "--timeout", "120", timeout=600)
            engine.stop()

    ratio = statistics.fmean(per_minute["containers"]) / statistics.fmean(per_minute["processes"])
    cpu_ratio = statistics.fmean(cpu_per_round["containers"]) / statistics.fmean(cpu_per_round["processes"])
    load = os.getloadavg()[0]
    for side, rates in per_minute.items():
        rounded, cpu = [round(r, 1) for r in rates], [round(c, 3) for c in cpu_per_round[side]]
        print(
            f"{side:10s}: rounds per minute per node {rounded}, mean {statistics.fmean(rates):.1f}; CPU s a round {cpu}"
        )
    print(
        f"containers / processes: rounds per minute {ratio:.3f}, CPU s a round {cpu_ratio:.3f} (side by side, "
        f"{minutes:.1f} minutes, load average {load:.1f})"
    )
    print(
        json.dumps(
            {
                "benchmark": "compose_swarm",
                "image_mib": size / 2**20,
                "build_s": build_s,
                "seconds_to_three_peers": to_three,
                "rounds_per_minute_per_node": per_minute,
                "containers_vs_processes": ratio,
                "cpu_s_per_round": cpu_per_round,
                "containers_vs_processes_cpu_s_per_round": cpu_ratio,
                "window_minutes": minutes,
                "load_average_1min": load,
            }
        )
    )


if __name__ == "__main__":
    main()
