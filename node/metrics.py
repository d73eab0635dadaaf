"""A state directory's metrics file, metrics.jsonl: one JSON row per round a node completed, or per step a pipeline
driver took (its rows count `step`, not `round`).

Rows are appended whole and fsynced (node/files.py), so a kill leaves at most a cut last line, which reading skips.
Torch-free: `swarm-node stats` reads it without loading a model library (tests/test_viewing_imports.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from node.files import append_json_line, atomic_write_text

METRICS_FILE = "metrics.jsonl"


class MetricsFile:
    def __init__(self, path: Path):
        self.path = path

    def append(self, row: dict[str, Any]) -> None:
        append_json_line(self.path, row)

    def read(self) -> list[dict[str, Any]]:
        """Complete rows only: a line cut by a kill is skipped."""
        rows = []
        try:
            lines = self.path.read_text().splitlines()
        except FileNotFoundError:
            return rows
        for line in lines:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            # a node's rounds, or a pipeline driver's steps
            if isinstance(row, dict) and isinstance(row.get("round", row.get("step")), int):
                rows.append(row)
        return rows

    def truncate(self, last_round: int) -> None:
        """Keep rows of rounds <= last_round (those the checkpoint contains)."""
        if not self.path.exists():
            return
        rows = [r for r in self.read() if r["round"] <= last_round]
        atomic_write_text(self.path, "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows))
