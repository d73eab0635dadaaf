"""benchmarks/gpu_round.py, prepared for a lent GPU machine, runs here in its tiny mode on the CPU."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from tests.helpers.common import CLI_TIMEOUT_S, REPO


@pytest.mark.integration
def test_the_gpu_script_runs_on_the_cpu_in_its_tiny_mode(cli_env, tmp_path):
    out = tmp_path / "gpu_round.json"
    script = str(REPO / "benchmarks" / "gpu_round.py")
    subprocess.run(
        [sys.executable, script, "--device", "cpu", "--device", "cpu@bfloat16", "--tiny", "--out", str(out)],
        check=True,
        cwd=tmp_path,
        env=cli_env,
        timeout=CLI_TIMEOUT_S,
    )
    line = json.loads(out.read_text())
    cpu, half = line["arms"]
    assert (cpu["dtype"], half["dtype"]) == ("float32", "bfloat16")
    for arm in (cpu, half):
        assert arm["device"] == "cpu" and arm["peak_gpu_memory_mib"] is None
        assert arm["rounds"] == arm["rounds_asked"] == 2
        assert arm["behaviour_logprobs"]["sequences"] == 16
        assert 0 <= arm["heldout_before"] <= 1 and 0 <= arm["heldout_after"] <= 1
        assert arm["rounds_per_s"] > 0 and arm["generated_tokens_per_s"] > 0
    # float32 is judged at the CPU tests' tolerance; bfloat16's rounding is reported, not judged
    assert cpu["behaviour_logprobs"]["ok"] is True and half["behaviour_logprobs"]["ok"] is None
    # a number all the same: an infinite gap is a sampled token one side gives no probability at all
    assert math.isfinite(half["behaviour_logprobs"]["max_abs_diff"])
    assert line["speedup_rounds_per_s"] > 0 and line["rounds_per_s_vs_last"][-1] == 1.0
