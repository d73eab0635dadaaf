"""benchmarks/gpu_round.py, prepared for a lent GPU machine, runs here in its tiny mode on the CPU."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers.common import CLI_TIMEOUT_S, REPO


def test_the_gpu_script_runs_on_the_cpu_in_its_tiny_mode(cli_env, tmp_path):
    out = tmp_path / "gpu_round.json"
    subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_round.py"), "--device", "cpu", "--tiny", "--out", str(out)],
        check=True,
        cwd=tmp_path,
        env=cli_env,
        timeout=CLI_TIMEOUT_S,
    )
    line = json.loads(out.read_text())
    [cpu] = line["arms"]
    assert cpu["device"] == "cpu" and cpu["rounds"] == cpu["rounds_asked"] == 2 and cpu["peak_gpu_memory_mib"] is None
    assert cpu["behaviour_logprobs"]["ok"] and cpu["behaviour_logprobs"]["sequences"] == 16
    assert 0 <= cpu["heldout_before"] <= 1 and 0 <= cpu["heldout_after"] <= 1
    assert cpu["rounds_per_s"] > 0 and cpu["generated_tokens_per_s"] > 0 and line["speedup_rounds_per_s"] is None
