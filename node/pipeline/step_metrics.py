"""A pipeline driver's metrics rows (node/pipeline/lm.py appends one per step), summed up for `swarm-node stats`.

Apart from the driver, which needs torch, so that `stats` loads no model library (tests/test_viewing_imports.py).
"""

from __future__ import annotations

import math
import statistics
from typing import Any


def summarize_steps(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """`swarm-node stats` for a pipeline driver: loss, validation loss, retries and the recoveries it waited for."""
    tenth = max(1, len(rows) // 10)
    validation = [r["val_loss"] for r in rows if "val_loss" in r and math.isfinite(r["val_loss"])]
    recoveries = [event for r in rows for event in r.get("recovery", [])]
    return {
        "steps": rows[-1]["step"],
        "loss_first_10pct": sum(r["loss"] for r in rows[:tenth]) / tenth,
        "loss_last_10pct": sum(r["loss"] for r in rows[-tenth:]) / tenth,
        "val_loss_first": validation[0] if validation else None,
        "val_loss_last": validation[-1] if validation else None,
        "step_s_mean": sum(r["step_s"] for r in rows) / len(rows),
        "retries": sum(r["retries"] for r in rows),
        "backward_failures": sum(r["backward_failures"] for r in rows),
        "repeated_calls": sum(sum(r.get("repeated_calls", {}).values()) for r in rows),
        "chain_fallbacks": sum(r.get("chain_fallbacks", 0) for r in rows),
        "stages_recovered": sum(1 for e in recoveries if e["replaced"]),
        "stalls": sum(1 for e in recoveries if not e["replaced"]),
        "recovery_s_mean": statistics.fmean(e["recovery_s"] for e in recoveries if e["replaced"])
        if any(e["replaced"] for e in recoveries)
        else None,
    }
