"""The tree passes the linter and the formatter configured in pyproject.toml ([tool.ruff]): `make lint` runs the same
checks."""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_ruff_finds_nothing():
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "node", "protocol", "tests", "benchmarks", "docs"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format_would_change_nothing():
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", "node", "protocol", "tests", "benchmarks", "docs"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
