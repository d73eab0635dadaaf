"""The adapter over hivemind's private API refuses a hivemind it was not written against, in one readable line, and
names the version pyproject.toml pins."""

from __future__ import annotations

import subprocess
import sys
import tomllib

import pytest

from node.transport.hivemind_p2p import HIVEMIND_VERSION, HivemindVersionError, check_hivemind_version
from tests.helpers.common import CLI_TIMEOUT_S, REPO


def test_the_adapter_is_written_against_the_hivemind_pyproject_pins():
    """Bumping the pin without going through the adapter's private calls fails here, not in a round."""
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert f"hivemind=={HIVEMIND_VERSION}" in dependencies


def test_another_hivemind_is_refused_naming_both_versions():
    check_hivemind_version(HIVEMIND_VERSION)  # the expected one passes
    with pytest.raises(HivemindVersionError) as refused:
        check_hivemind_version("1.2.0")
    message = str(refused.value)
    assert "hivemind 1.2.0 found" in message and f"hivemind=={HIVEMIND_VERSION}" in message
    assert "\n" not in message
    assert isinstance(refused.value, ImportError)
    with pytest.raises(HivemindVersionError, match=r"hivemind \(not installed\) found"):
        check_hivemind_version(None)


def test_importing_the_adapter_checks_the_installed_version():
    """In a fresh interpreter that reports another installed hivemind, the import fails with that line, before
    hivemind itself is imported."""
    script = (
        "import importlib.metadata, sys\n"
        "importlib.metadata.version = lambda name: '1.2.0' if name == 'hivemind' else None\n"
        "try:\n"
        "    import node.transport.hivemind_p2p\n"
        "except ImportError as exc:\n"
        "    print(type(exc).__name__, exc)\n"
        "    print('hivemind' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=CLI_TIMEOUT_S
    )
    assert result.returncode == 0, result.stderr
    refusal, hivemind_loaded = result.stdout.strip().splitlines()
    assert refusal.startswith("HivemindVersionError hivemind 1.2.0 found") and HIVEMIND_VERSION in refusal
    assert hivemind_loaded == "False"
