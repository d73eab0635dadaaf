"""compose.yaml on a Docker engine of our own: the image built as compose.yaml names it, and a compose project of
it (tests/test_compose_up.py, benchmarks/compose_swarm.py).

`docker build` mounts nothing, so this machine's wheel folders and indexes (what tests/test_container.py mounts into
buildah's build) are served on 127.0.0.1 to a build on the host's network, and pip trusts this machine's CA bundle
from the local Debian base."""

from __future__ import annotations

import json
import subprocess
import tempfile
import threading
import time
import uuid
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import yaml

from tests.helpers.common import REPO, get_json
from tests.helpers.docker_engine import DockerEngine
from tests.helpers.images import (
    BUILD_TIMEOUT_S,
    debian_rootfs,
    pip_build_arguments,
    has_local_torch,
    host_pip_sources,
    run,
)

COMPOSE_FILE = REPO / "compose.yaml"
COMPOSE = yaml.safe_load(COMPOSE_FILE.read_text())
IMAGE = COMPOSE["x-node"]["image"]
BASE_IMAGE = "swarm-node-base:bookworm"
SERVICES = ("node0", "node1", "node2")
DASHBOARD = "http://127.0.0.1:8765/"
# {command: Debian package} of what runs compose.yaml here (compose v1: Debian has no v2 plugin)
ENGINE_PACKAGES = {"dockerd": "docker.io", "docker-compose": "docker-compose", "debootstrap": "debootstrap"}


class LocalWheels:
    """This machine's wheel folders and simple indexes served over HTTP on 127.0.0.1, for a build that runs on the
    host's network: the stand-in for buildah's read-only mounts."""

    def __init__(self, scratch: Path):
        folders, indexes = host_pip_sources()
        root = scratch / "served"
        root.mkdir(parents=True)
        self.find_links, self.index_paths = [], []
        for i, folder in enumerate(folders):
            (root / f"links{i}").symlink_to(folder)
            self.find_links.append(f"links{i}/")
        for i, url in enumerate(indexes):
            index = Path(url.removeprefix("file://"))
            # a simple index's pages link to ../../files/...: serve its parent
            (root / f"index{i}").symlink_to(index.parent)
            self.index_paths.append(f"index{i}/{index.name}")
        self.has_torch = has_local_torch(folders)
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), partial(_QuietHandler, directory=str(root)))
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def pip_options(self) -> list[str]:
        base = f"http://127.0.0.1:{self.server.server_address[1]}/"
        return [
            "--trusted-host",
            "127.0.0.1",
            *(option for path in self.find_links for option in ("--find-links", base + path)),
            *(option for path in self.index_paths for option in ("--extra-index-url", base + path)),
        ]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - the base class's signature
        pass


def build_base(engine: DockerEngine) -> None:
    """The Debian base, imported once (kept in the test engine's data root): Python 3.11, venv, and this machine's
    CA bundle at /etc/ssl/certs/host-ca.crt for pip (buildah's build mounts it; `docker build` cannot)."""
    if engine.docker("image", "inspect", BASE_IMAGE, check=False).returncode == 0:
        return
    with tempfile.TemporaryDirectory(dir="/var/tmp", prefix="swarm-node-rootfs-") as scratch:
        with debian_rootfs(Path(scratch), with_host_ca=True) as packed:
            engine.docker("import", "--change", 'CMD ["python3"]', "-", BASE_IMAGE, stdin=packed, timeout=600)


def build_image(engine: DockerEngine, scratch: Path) -> float:
    """The base if missing, then `docker build` of the shipped Dockerfile tagged as compose.yaml's image: the build's
    wall seconds (a rebuild reuses the engine's cached layers)."""
    build_base(engine)
    wheels = LocalWheels(scratch)
    started = time.monotonic()
    try:
        engine.docker(
            "build",
            "--network",
            "host",
            "--tag",
            IMAGE,
            "--build-arg",
            f"BASE_IMAGE={BASE_IMAGE}",
            *pip_build_arguments(["--cert", "/etc/ssl/certs/host-ca.crt"], wheels.pip_options(), wheels.has_torch),
            str(REPO),
            timeout=BUILD_TIMEOUT_S,
        )
    finally:
        wheels.close()
    return time.monotonic() - started


def image_size(engine: DockerEngine) -> int:
    """The image's size in bytes, as `docker images` counts it."""
    return json.loads(engine.docker("image", "inspect", IMAGE).stdout)[0]["Size"]


class Project:
    """compose.yaml under a project name of this test run, on the test's engine."""

    def __init__(self, engine: DockerEngine):
        self.engine = engine
        self.name = f"swarmnodetest{uuid.uuid4().hex[:8]}"

    def compose(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        return run(
            "docker-compose",
            "--project-name",
            self.name,
            "--file",
            str(COMPOSE_FILE),
            *args,
            env=self.engine.env,
            cwd=REPO,
            timeout=timeout,
        )

    def volume(self, name: str) -> Path:
        """A named volume's folder on this host (the engine runs here, as root)."""
        inspected = self.engine.docker("volume", "inspect", f"{self.name}_{name}").stdout
        return Path(json.loads(inspected)[0]["Mountpoint"])

    def state(self, service: str) -> Path:
        return self.volume(service) / "node"

    def container(self, service: str) -> dict:
        return json.loads(self.engine.docker("inspect", f"{self.name}_{service}_1").stdout)[0]

    def logs(self, service: str) -> str:
        """The container's output, its stdout and stderr in the order it wrote them."""
        return subprocess.run(
            ["docker", "logs", f"{self.name}_{service}_1"],
            env=self.engine.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=120,
            check=True,
        ).stdout

    def assert_running(self) -> None:
        for service in SERVICES:
            state = self.container(service)["State"]
            assert state["Running"], f"{service} exited with {state['ExitCode']}:\n{self.logs(service)[-3000:]}"

    def leftovers(self) -> list[str]:
        label = f"label=com.docker.compose.project={self.name}"
        return [
            *self.engine.docker("ps", "--all", "--quiet", "--filter", label).stdout.split(),
            *self.engine.docker("volume", "ls", "--quiet", "--filter", label).stdout.split(),
            *self.engine.docker("network", "ls", "--quiet", "--filter", label).stdout.split(),
        ]


def peers_on_dashboard(url: str = DASHBOARD) -> list[dict]:
    """The dashboard's peer rows, [] while it does not answer."""
    try:
        return get_json(url + "api/peers")
    except OSError:
        return []
