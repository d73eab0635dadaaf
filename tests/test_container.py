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
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

from tests.helpers.common import REPO, TINY_OVERRIDES
from tests.helpers.swarm import SWARM_OVERRIDES, read_rows, wait_for

BASE_IMAGE = "localhost/swarm-node-base:bookworm"
IMAGE = "localhost/swarm-node:test"
# debootstrap's minimal variant plus what the Dockerfile's build stage needs from its base.
BASE_PACKAGES = "python3,python3-venv,python3-pip"
# Building installs torch and ~100 packages, compiling two: a hang guard, not a speed check
# (from empty storage on the loaded 2 cores: 6 min for the base, 11 for the image).
BUILD_TIMEOUT_S = 3600

# The suite's 600 s per test counts the fixtures too, and the first test builds the image.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2 * BUILD_TIMEOUT_S + 1800)]
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")


def run(*args: str, timeout: float = 600, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(args, capture_output=True, text=True, timeout=timeout, **kwargs)
    assert result.returncode == 0, (
        f"{shlex.join(args)} exited {result.returncode}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    )
    return result


def install_missing(commands: dict[str, str]) -> str | None:
    """Install the Debian packages ({command: package}) whose commands are missing; why not, if that failed."""
    missing = sorted({package for command, package in commands.items() if not shutil.which(command)})
    if not missing:
        return None
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return f"{', '.join(missing)} missing and cannot be installed here (apt-get as root is needed)"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(["apt-get", "update", "-qq"], capture_output=True, env=env, timeout=900)
    installed = subprocess.run(
        ["apt-get", "install", "-y", "-qq", *missing], capture_output=True, text=True, env=env, timeout=900
    )
    still_missing = [command for command in commands if not shutil.which(command)]
    if still_missing:
        return (
            f"{', '.join(still_missing)} missing and `apt-get install {' '.join(missing)}` failed: "
            f"{installed.stderr.strip()[-500:]}"
        )
    return None


def image_exists(name: str) -> bool:
    return subprocess.run(["buildah", "inspect", "--type", "image", name], capture_output=True).returncode == 0


def build_debian_base() -> None:
    """A Debian bookworm base with Python 3.11 and venv, the local stand-in for python:3.11-slim."""
    with tempfile.TemporaryDirectory(dir="/var/tmp", prefix="swarm-node-rootfs-") as scratch:
        rootfs = Path(scratch) / "rootfs"
        run(
            "nice",
            "-n",
            "10",
            "debootstrap",
            "--variant=minbase",
            f"--include={BASE_PACKAGES}",
            "bookworm",
            str(rootfs),
            timeout=BUILD_TIMEOUT_S,
        )
        container = run("buildah", "from", "scratch").stdout.strip()
        try:
            mount = run("buildah", "mount", container).stdout.strip()
            # Downloaded packages and apt's lists would only make every layer above heavier.
            packed = subprocess.Popen(
                [
                    "tar",
                    "-C",
                    str(rootfs),
                    "--exclude=./var/cache/apt/archives/*.deb",
                    "--exclude=./var/lib/apt/lists/*",
                    "-c",
                    ".",
                ],
                stdout=subprocess.PIPE,
            )
            run("tar", "-C", mount, "-x", stdin=packed.stdout)
            assert packed.wait() == 0
            run("buildah", "umount", container)
            run("buildah", "config", "--cmd", "python3", container)
            run("buildah", "commit", "-q", container, BASE_IMAGE)
        finally:
            subprocess.run(["buildah", "rm", container], capture_output=True)


def host_pip_sources() -> tuple[list[str], list[str]]:
    """This machine's wheel folders and file:// indexes, from pip's configuration: (find-links folders, index URLs)."""
    listed = run(sys.executable, "-m", "pip", "config", "list").stdout
    folders, indexes = [], []
    for line in listed.splitlines():
        key, _, value = line.partition("=")
        for source in value.strip("'\"").split():
            if key.endswith(".find-links") and Path(source).is_dir() and source not in folders:
                folders.append(source)
            elif key.endswith(".extra-index-url") and source.startswith("file://") and source not in indexes:
                indexes.append(source)
    return folders, indexes


def dockerfile_default(argument: str) -> str:
    match = re.search(rf'^ARG {argument}="(.*)"$', (REPO / "Dockerfile").read_text(), re.MULTILINE)
    assert match, f"the Dockerfile declares no default for {argument}"
    return match.group(1)


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
    # torch from a local folder where one holds the CPU build, else from the Dockerfile's default source.
    has_local_torch = any(next(Path(folder).glob("torch-2.13.0+cpu-*.whl"), None) for folder in folders)
    torch_source = (
        shlex.join([*trust, *local]) if has_local_torch else " ".join([*trust, dockerfile_default("TORCH_SOURCE")])
    )
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
        "--build-arg",
        f"TORCH_SOURCE={torch_source}",
        "--build-arg",
        f"PIP_OPTIONS={shlex.join([*trust, *local])}",
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
    command = [*image_command(image), "--rounds", "2", *settings([*TINY_OVERRIDES, "eval_every=2"])]
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
