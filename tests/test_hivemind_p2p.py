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


@pytest.mark.integration
def test_a_stream_whose_daemon_hangs_up_before_its_header_ends_quietly(caplog):
    """The daemon connects to the node once per incoming stream and sends the stream's header first; one killed before
    the header was whole left asyncio's "Unhandled exception in client_connected_cb" and a traceback in a stage
    server's log (seen when the soak killed its p2pd). Hanging up on the listener as such a daemon does ends quietly."""
    import asyncio
    import logging

    from node.transport.hivemind_p2p import create_p2p, stream_listener_path

    async def scenario():
        p2p = await create_p2p()
        try:

            async def handler(stream_info, reader, writer):  # never reached: no header comes
                writer.close()

            await p2p.add_binary_stream_handler("/test/hang-up", handler)
            for _ in range(3):
                reader, writer = await asyncio.open_unix_connection(stream_listener_path(p2p))
                writer.write(b"\x05")  # a header's length, then nothing: the daemon died mid-header
                await writer.drain()
                writer.close()
                await writer.wait_closed()
            await asyncio.sleep(0.5)  # the listener's callbacks run and end
        finally:
            await p2p.shutdown()

    with caplog.at_level(logging.DEBUG):
        asyncio.run(scenario())
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]
    ended = [r for r in caplog.records if "an incoming stream ended early" in r.getMessage()]
    assert len(ended) == 3  # each hang-up reached the listener and was taken as the stream's end
