"""`docker-compose up` of the shipped compose.yaml on a real Docker engine, as a user runs it.

The test starts a dockerd of its own (tests/helpers/docker_engine.py), builds the shipped Dockerfile with
`docker build` on a local Debian base and this machine's wheels (the build arguments tests/test_container.py passes
to buildah; the wheels are served on 127.0.0.1 to a build on the host's network, since `docker build` mounts
nothing), tags it as compose.yaml's `image:`, and runs compose.yaml unchanged. Then, in this order:
1. nodes 1 and 2 join node 0 over the compose network through the address node 0 writes, and each of the three
   trains on the other two's rollouts (their swarm.json);
2. the dashboard on the host's 127.0.0.1:8765 lists the three peers, in headless Chromium too;
3. `docker-compose stop` makes each node finish its round, save and exit 0 within the grace period;
4. `docker-compose up` again resumes every node from its named volume: rounds go on, the model is not rebuilt;
5. `down -v` removes containers, network and volumes; dockerd is stopped by its PID, and the host's iptables,
   ip_forward and links are as before the test.
Skipped, with the reason, only where dockerd, docker-compose or debootstrap cannot be installed.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from tests.helpers.browser import run_chromium
from tests.helpers.compose import (
    DASHBOARD,
    ENGINE_PACKAGES,
    SERVICES,
    Project,
    build_image,
    image_size,
    peers_on_dashboard,
)
from tests.helpers.docker_engine import DockerEngine, HostNetworking
from tests.helpers.images import BUILD_TIMEOUT_S, install_missing
from tests.helpers.swarm import read_rows, wait_for

# The default model is built in the first container (30-40 s idle, minutes on a loaded 2 cores) before node 0
# writes its address: a hang guard, not a speed check.
START_TIMEOUT_S = 900

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2 * BUILD_TIMEOUT_S + 3600)]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    missing = install_missing(ENGINE_PACKAGES)
    if missing:
        pytest.skip(missing)
    engine = DockerEngine(tmp_path_factory.mktemp("compose") / "dockerd.log")
    try:
        engine.start()
        yield engine
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def image(engine, tmp_path_factory) -> str:
    seconds = build_image(engine, tmp_path_factory.mktemp("wheels"))
    print(f"image: {image_size(engine) / 2**20:.0f} MiB, built in {seconds:.0f} s")
    return "built"


def trained_on(state: Path) -> dict[str, int]:
    """{peer id: questions of that peer's this node trained on}, from its swarm.json."""
    path = state / "swarm.json"
    if not path.exists():
        return {}
    return {peer: c["questions_used"] for peer, c in json.loads(path.read_text())["peers"].items()}


def test_compose_up_swarm_dashboard_stop_resume_down(engine, image, tmp_path):
    project = Project(engine)
    try:
        project.compose("up", "--detach", "--no-build")
        started = time.monotonic()

        # 1. the three join over the compose network, through the address node 0 writes, and train on each other
        seed_addresses = wait_for(
            lambda: (
                project.assert_running()
                or ((project.state("node0") / "addresses.txt").exists() and project.state("node0") / "addresses.txt")
            ),
            START_TIMEOUT_S,
            "node 0's addresses",
            interval=2,
        ).read_text()
        node0_ip = next(iter(project.container("node0")["NetworkSettings"]["Networks"].values()))["IPAddress"]
        assert f"/ip4/{node0_ip}/tcp/31337/p2p/" in seed_addresses, (seed_addresses, node0_ip)
        # listening on 0.0.0.0, it writes what others can dial: its compose-network address (and its loopback,
        # which a joiner in another container cannot reach: only the former can carry the join below)
        assert "0.0.0.0" not in seed_addresses
        peers = wait_for(
            lambda: project.assert_running() or (len(listed := peers_on_dashboard()) == 3 and listed),
            START_TIMEOUT_S,
            "three peers on the dashboard",
            interval=2,
        )
        to_three_peers_s = time.monotonic() - started
        ids = {row["display_name"]: row["node_id"] for row in peers}
        assert set(ids) == {"node-0", "node-1", "node-2"}, peers
        for service, name in zip(SERVICES, ("node-0", "node-1", "node-2")):
            others = {ids[other] for other in ids if other != name}
            wait_for(
                lambda: (
                    project.assert_running()
                    or {peer for peer, used in trained_on(project.state(service)).items() if used > 0} >= others
                ),
                START_TIMEOUT_S,
                f"{service} to train on both others' rollouts",
                interval=2,
            )

        # the engine's healthcheck (`swarm-node health`, each node's /readyz) finds every node ready
        for service in SERVICES:
            wait_for(
                lambda: (
                    project.assert_running()
                    or project.container(service)["State"].get("Health", {}).get("Status") == "healthy"
                ),
                START_TIMEOUT_S,
                f"{service}'s healthcheck to pass",
                interval=2,
            )

        # 2. the dashboard, published on the host's loopback, in a real browser
        dom = run_chromium(tmp_path / "chromium", "--virtual-time-budget=10000", "--dump-dom", DASHBOARD)
        assert len(re.findall(r"<tr[^>]*data-peer-row", dom)) == 3, dom[:3000]
        assert all(name in dom for name in ("node-0", "node-1", "node-2"))

        # 3. stop: each node finishes its round, saves and exits 0 within the grace period
        rounds_before = {service: read_rows(project.state(service))[-1]["round"] for service in SERVICES}
        project.compose("stop", timeout=600)
        for service in SERVICES:
            state = project.container(service)["State"]
            last_line = project.logs(service).strip().splitlines()[-1]
            print(f"{service}: exit {state['ExitCode']}, last line: {last_line}")
            assert state["ExitCode"] == 0, project.logs(service)[-3000:]
            saved = read_rows(project.state(service))[-1]["round"]
            assert saved >= rounds_before[service]
            assert f"saved round {saved} " in last_line, last_line
            latest = (project.state(service) / "checkpoints" / "LATEST").read_text().strip()
            assert latest == f"round-{saved:08d}", latest
        cache = project.volume("model-cache")
        cached = {path: path.stat().st_mtime_ns for path in cache.rglob("*") if path.is_file()}
        assert cached, "the model cache volume is empty"

        # 4. up again: every node resumes from its volume, the model is not rebuilt
        saved = {service: read_rows(project.state(service))[-1]["round"] for service in SERVICES}
        project.compose("up", "--detach", "--no-build")
        for service in SERVICES:
            rows = wait_for(
                lambda: (
                    project.assert_running()
                    or ((rows := read_rows(project.state(service)))[-1]["round"] > saved[service] and rows)
                ),
                START_TIMEOUT_S,
                f"{service} to go on training",
                interval=2,
            )
            rounds = [row["round"] for row in rows]
            assert rounds == list(range(1, rounds[-1] + 1)), f"{service}: rounds not continuous: {rounds}"
            assert f"resuming at round {saved[service]}" in project.logs(service)
        now_cached = {path: path.stat().st_mtime_ns for path in cache.rglob("*") if path.is_file()}
        assert now_cached == cached, "the model cache was rebuilt or rewritten"
        wait_for(lambda: len(peers_on_dashboard()) == 3, START_TIMEOUT_S, "three peers again", interval=2)
        print(f"compose up to three peers on the dashboard: {to_three_peers_s:.0f} s")
    finally:
        # 5. down -v removes all of it
        project.compose("down", "--volumes", "--timeout", "120", timeout=600)
    assert project.leftovers() == []
    engine.stop()  # by its PID, and the host's networking put back
    assert not Path(f"/proc/{engine.process.pid}").exists()
    after = HostNetworking.now()
    assert after.differences(engine.host_before) == []
    assert after.forward_policy() == engine.host_before.forward_policy()
