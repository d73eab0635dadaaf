"""Layers import downward only: what validates a peer's record or carries rollouts loads no model library."""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def imported_after(modules: list[str]) -> set[str]:
    code = f"import sys; import {', '.join(modules)}; print(' '.join(sorted(sys.modules)))"
    return set(subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, capture_output=True, text=True).stdout.split())


def test_the_record_validator_transports_and_stats_load_no_model_library():
    loaded = imported_after(["node.transport.records", "node.transport.base", "node.stats", "node.files"])
    assert not loaded & {"transformers", "node.model", "node.state", "node.trainer"}


def test_rollout_data_types_are_torch_free():
    loaded = imported_after(["node.rollouts.base", "node.files"])
    assert "torch" not in loaded and "node.trainer" not in loaded
