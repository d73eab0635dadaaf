"""Headless Chromium for the tests that look at a page as a person would (the dashboard)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest


def chromium_binary() -> str:
    binary = os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if binary is None:
        pytest.fail(
            "no chromium on PATH: `make install` installs it (apt-get install chromium), or set "
            "CHROMIUM=/path/to/chromium"
        )
    return binary


def run_chromium(profile: Path, *args: str, timeout: float = 180) -> str:
    """Headless Chromium in its own process group (its zygote and renderers with it), killed as a group on timeout."""
    command = [
        chromium_binary(),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        f"--user-data-dir={profile}",
        "--hide-scrollbars",
        "--window-size=1280,1400",
        *args,
    ]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise
    assert process.returncode == 0, err.decode(errors="replace")[-2000:]
    return out.decode()


def chart_points(dom: str, chart: str) -> int:
    match = re.search(rf'<svg[^>]*data-chart="{chart}"[^>]*>', dom)
    assert match, f"no chart {chart} in the page"
    points = re.search(r'data-points="(\d+)"', match.group(0))
    return int(points.group(1)) if points else 0
