"""The container image, built and run without a Docker engine: buildah builds the Dockerfile
as shipped (only its build arguments differ) on a local Debian base with this machine's own
wheels, and `buildah run --isolation chroot` runs it (podman's runtime cannot set rlimits here).
A chrooted container shares the host's network, so two containers join each other on 127.0.0.1.

The base image and the built image are kept in buildah's storage between runs (a rebuild then
reuses its cached layers); the working containers a test starts are removed at its end.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import uuid
from pathlib import Path

import pytest

from tests.helpers.common import REPO, TINY_OVERRIDES
from tests.helpers.images import (
    BUILD_TIMEOUT_S,
    HOST_CA_BUNDLE,
    debian_rootfs,
    pip_build_arguments,
    has_local_torch,
    host_pip_sources,
    install_missing,
    run,
)
from tests.helpers.swarm import SWARM_OVERRIDES, read_rows, wait_for

BASE_IMAGE = "localhost/swarm-node-base:bookworm"
IMAGE = "localhost/swarm-node:test"

# The suite's 600 s per test counts the fixtures too, and the first test builds the image.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2 * BUILD_TIMEOUT_S + 1800)]


def image_exists(name: str) -> bool:
    return subprocess.run(["buildah", "inspect", "--type", "image", name], capture_output=True).returncode == 0


def build_debian_base() -> None:
    """A Debian bookworm base with Python 3.11 and venv, the local stand-in for python:3.11-slim."""
    with tempfile.TemporaryDirectory(dir="/var/tmp", prefix="swarm-node-rootfs-") as scratch:
        container = run("buildah", "from", "scratch").stdout.strip()
        try:
            mount = run("buildah", "mount", container).stdout.strip()
            with debian_rootfs(Path(scratch)) as packed:
                run("tar", "-C", mount, "-x", stdin=packed)
            run("buildah", "umount", container)
            run("buildah", "config", "--cmd", "python3", container)
            run("buildah", "commit", "-q", container, BASE_IMAGE)
        finally:
            subprocess.run(["buildah", "rm", container], capture_output=True)


def build_image() -> None:
    folders, indexes = host_pip_sources()
    # A simple index's pages link to its files with relative paths (../../files/...): mount its parent.
    mounts = sorted({*folders, *(str(Path(url.removeprefix("file://")).parent) for url in indexes)})
    volumes = [f"--volume={folder}:{folder}:ro" for folder in mounts]
    trust = []
    if HOST_CA_BUNDLE.exists():  # pip in the build trusts what this machine trusts (a registry proxy's CA, say)
        volumes.append(f"--volume={HOST_CA_BUNDLE}:/etc/ssl/certs/host-ca.crt:ro")
        trust = ["--cert", "/etc/ssl/certs/host-ca.crt"]
    local = [
        *(option for folder in folders for option in ("--find-links", folder)),
        *(option for url in indexes for option in ("--extra-index-url", url)),
    ]
    run(
        "nice",
        "-n",
        "10",
        "buildah",
        "bud",
        "--isolation",
        "chroot",
        "--layers",
        "--force-rm",
        "-t",
        IMAGE,
        "--build-arg",
        f"BASE_IMAGE={BASE_IMAGE}",
        *pip_build_arguments(trust, local, has_local_torch(folders)),
        *volumes,
        "-f",
        str(REPO / "Dockerfile"),
        str(REPO),
        timeout=BUILD_TIMEOUT_S,
    )


@pytest.fixture(scope="module")
def image() -> str:
    missing = install_missing({"buildah": "buildah", "debootstrap": "debootstrap"})
    if missing:
        pytest.skip(missing)
    if not image_exists(BASE_IMAGE):
        build_debian_base()
    build_image()
    return IMAGE


def image_command(image: str) -> list[str]:
    """The image's entrypoint and default command, as `docker run IMAGE` would run them."""
    config = json.loads(run("buildah", "inspect", "--type", "image", image).stdout)["OCIv1"]["config"]
    return [*config["Entrypoint"], *config["Cmd"]]


class Containers:
    """Working containers of the image, each named for this test run, removed at the end."""

    def __init__(self, image: str):
        self.image = image
        self.names: list[str] = []
        self.processes: list[subprocess.Popen] = []
        self.logs = []
        self.log_paths: list[Path] = []

    def create(self) -> str:
        name = f"swarm-node-test-{uuid.uuid4().hex[:8]}"
        run("buildah", "from", "--name", name, self.image)
        self.names.append(name)
        return name

    def arguments(self, name: str, volumes: dict[Path, str], command: list[str]) -> list[str]:
        mounts = [f"--volume={host}:{inside}" for host, inside in volumes.items()]
        return ["buildah", "run", "--isolation", "chroot", *mounts, name, "--", *command]

    def run(self, volumes: dict[Path, str], command: list[str]) -> subprocess.CompletedProcess:
        return run(*self.arguments(self.create(), volumes, command), timeout=BUILD_TIMEOUT_S)

    def start(self, volumes: dict[Path, str], command: list[str], log_path: Path) -> subprocess.Popen:
        log = open(log_path, "w")
        self.logs.append(log)
        self.log_paths.append(log_path)
        # Its own process group: buildah and the node under it get the signal, nothing else.
        process = subprocess.Popen(
            self.arguments(self.create(), volumes, command),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.processes.append(process)
        return process

    def assert_running(self) -> None:
        for process, log_path in zip(self.processes, self.log_paths):
            if process.poll() is not None:
                raise AssertionError(f"container exited with {process.returncode}: {log_path.read_text()[-3000:]}")

    def close(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGINT)  # a node saves and exits on Ctrl-C
                try:
                    process.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait(timeout=30)
        for log in self.logs:
            log.close()
        for name in self.names:
            subprocess.run(["buildah", "rm", name], capture_output=True)


@pytest.fixture
def containers(image):
    group = Containers(image)
    yield group
    group.close()


@pytest.fixture(scope="module")
def model_cache_folder(tmp_path_factory) -> Path:
    """One host folder for the default model's cache, shared by every container of the module."""
    return tmp_path_factory.mktemp("container-model-cache")


def settings(overrides: list[str]) -> list[str]:
    return [argument for override in overrides for argument in ("--set", override)]


def test_the_image_trains_with_its_state_in_a_host_folder(image, containers, model_cache_folder, tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    # The image's own default command (isolated training, state under /state), for two rounds of a tiny model.
    # (its metrics port on any free one: a chrooted container shares the host's network, and 9100 may be taken)
    command = [
        *image_command(image),
        "--rounds",
        "2",
        *settings([*TINY_OVERRIDES, "eval_every=2", "swarm.metrics_port=0"]),
    ]
    result = containers.run({state: "/state", model_cache_folder: "/state/cache"}, command)
    rows = read_rows(state / "node")
    assert [row["round"] for row in rows] == [1, 2], result.stdout[-2000:]
    assert all(0.0 <= row["accuracy"] <= 1.0 and row["tokens_per_s"] > 0 for row in rows)
    assert (state / "node" / "checkpoints" / "LATEST").read_text().strip() == "round-00000002"
    assert (state / "node" / "checkpoints" / "round-00000002" / "model.safetensors").stat().st_size > 0
    assert "Warning" not in result.stdout + result.stderr  # the first screen is clean in the image too


def test_two_containers_join_each_other_and_train_on_each_others_rollouts(
    image, containers, model_cache_folder, tmp_path
):
    swarm = [*settings(SWARM_OVERRIDES), "--config", "/app/configs/swarm.yaml", "--state-dir", "/state/node"]
    states = {name: tmp_path / name for name in ("a", "b")}
    for folder in states.values():
        folder.mkdir()

    def volumes(name: str) -> dict[Path, str]:
        return {states[name]: "/state", model_cache_folder: "/state/cache"}

    containers.start(volumes("a"), ["swarm-node", "join", *swarm], tmp_path / "a.out")
    addresses = states["a"] / "node" / "addresses.txt"
    address = wait_for(
        lambda: containers.assert_running() or (addresses.exists() and addresses.read_text().split()),
        300,
        "container a's address",
    )[0]
    containers.start(volumes("b"), ["swarm-node", "join", *swarm, "--initial-peers", address], tmp_path / "b.out")
    for name in ("a", "b"):
        wait_for(
            lambda: (
                containers.assert_running()
                or any(row.get("external_questions", 0) > 0 for row in read_rows(states[name] / "node"))
            ),
            300,
            f"container {name} to train on the other's rollouts",
            interval=1,
        )


def test_docker_compose_accepts_the_compose_file():
    """Debian's docker-compose (1.29) checks compose.yaml against the Compose schema and resolves it;
    its `config` command needs no engine. tests/test_compose.py checks the commands themselves."""
    missing = install_missing({"docker-compose": "docker-compose"})
    if missing:
        pytest.skip(missing)
    run("docker-compose", "--file", str(REPO / "compose.yaml"), "config", "--quiet", cwd=REPO)
