"""What the container tests share: Debian packages installed where missing, a local Debian base (the stand-in for
python:3.11-slim, which no registry here serves), and this machine's own wheel sources for the Dockerfile's pip.

tests/test_container.py builds with buildah (no engine), tests/test_compose_up.py with a real Docker engine."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

from tests.helpers.common import REPO

# debootstrap's minimal variant plus what the Dockerfile's build stage needs from its base.
BASE_PACKAGES = "python3,python3-venv,python3-pip"
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
# Building installs torch and ~100 packages, compiling two: a hang guard, not a speed check
# (from empty storage on the loaded 2 cores: 6 min for the base, 11 for the image).
BUILD_TIMEOUT_S = 3600


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
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    still_missing = [command for command in commands if not shutil.which(command)]
    if still_missing:
        return (
            f"{', '.join(still_missing)} missing and `apt-get install {' '.join(missing)}` failed: "
            f"{installed.stderr.strip()[-500:]}"
        )
    return None


@contextmanager
def debian_rootfs(scratch: Path, with_host_ca: bool = False):
    """A Debian bookworm root file system with Python 3.11 and venv, yielded as a running `tar` of it (its stdout):
    what an image's base layer is made of. Downloaded packages and apt's lists are left out (they would only make
    every layer above heavier). with_host_ca: this machine's CA bundle at /etc/ssl/certs/host-ca.crt, for a build
    that cannot mount it (pip in the build trusts what this machine trusts: a registry proxy's CA, say)."""
    rootfs = scratch / "rootfs"
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
    if with_host_ca and HOST_CA_BUNDLE.exists():
        shutil.copyfile(HOST_CA_BUNDLE, rootfs / "etc/ssl/certs/host-ca.crt")
    packed = subprocess.Popen(
        ["tar", "-C", str(rootfs), "--exclude=./var/cache/apt/archives/*.deb", "--exclude=./var/lib/apt/lists/*"]
        + ["-c", "."],
        stdout=subprocess.PIPE,
    )
    try:
        yield packed.stdout
    finally:
        packed.stdout.close()
        assert packed.wait() == 0


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


def has_local_torch(folders: list[str]) -> bool:
    """Whether one of the wheel folders holds the CPU build of torch the Dockerfile installs."""
    return any(next(Path(folder).glob("torch-2.13.0+cpu-*.whl"), None) for folder in folders)


def pip_build_arguments(trust: list[str], sources: list[str], has_torch: bool) -> list[str]:
    """The Dockerfile's TORCH_SOURCE and PIP_OPTIONS build arguments: pip's trust options (this machine's CA bundle)
    and this machine's wheel sources; torch from those sources where they hold the CPU build, else from the
    Dockerfile's default source."""
    local = [*trust, *sources]
    torch_source = shlex.join(local) if has_torch else " ".join([*trust, dockerfile_default("TORCH_SOURCE")])
    return ["--build-arg", f"TORCH_SOURCE={torch_source}", "--build-arg", f"PIP_OPTIONS={shlex.join(local)}"]


def dockerfile_default(argument: str) -> str:
    match = re.search(rf'^ARG {argument}="(.*)"$', (REPO / "Dockerfile").read_text(), re.MULTILINE)
    assert match, f"the Dockerfile declares no default for {argument}"
    return match.group(1)
