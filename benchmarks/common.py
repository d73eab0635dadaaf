"""What the benchmarks share: a spread over seeds, the results files under benchmarks/results/, and the JSON line a
benchmark ends with.

A results file holds one JSON row per run, appended as each run ends (node.files.append_json_line: a crash leaves
the rows before it whole). A campaign that keeps its runs under a key, the settings that make two runs comparable,
reads back only its key's rows, so that runs of other settings in the same file never mix into its figures and a run
already there is not run again.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from node.files import append_json_line

REPO = Path(__file__).resolve().parents[1]


def spread(values: list[float]) -> dict[str, float]:
    """The mean of per-seed values with their standard deviation (0 for one seed), min and max."""
    return {
        "mean": statistics.fmean(values),
        "stdev": statistics.stdev(values) if len(values) > 1 else 0.0,
        "min": min(values),
        "max": max(values),
    }


def read_json_lines(path: Path) -> list[dict]:
    """Every row of a JSON-lines file, in order; none where the file does not exist yet."""
    path = Path(path)
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def append_keyed_row(path: Path, key: dict, result: dict) -> dict:
    """Append a run's row to the results file at `path` under `key`, dated and with the load it ran at; returns it."""
    row = {"key": key, "date": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()), "load_average": os.getloadavg()}
    row.update(result)
    append_json_line(path, row)
    return row


def read_keyed_rows(path: Path, key: dict, serves: Callable[[dict], bool] = lambda row: False) -> list[dict]:
    """The rows of the results file at `path` kept under `key`, and those of another key that `serves(row)` says count
    for it too (a failure-free run that serves every checkpoint rule, say)."""
    return [row for row in read_json_lines(path) if row.get("key") == key or serves(row)]


def print_result_line(line: dict, results: Path | None = None) -> None:
    """End a benchmark: its JSON line appended to `results` where one is given, and printed."""
    if results is not None:
        append_json_line(results, line)
    print(json.dumps(line))


def seeds_parser(description: str, config: Path, rounds: int) -> argparse.ArgumentParser:
    """The arguments of a benchmark that runs one config's arms per seed: --config, --seeds, --first-seed, --rounds,
    --set and --results; the benchmark adds its own."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", type=Path, default=config)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override")
    parser.add_argument("--results", type=Path, help="append each seed's row to this file")
    return parser


def run_seeds(args: argparse.Namespace, run_seed: Callable, describe: Callable[[int, dict], str]) -> list[dict]:
    """`run_seed(args, seed)` for each seed in turn, transformers' warnings and bars off; each seed's row is appended to
    --results as it finishes (so that seeds accumulate over sessions) and `describe(seed, row)` printed; the rows."""
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    rows = []
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        row = run_seed(args, seed)
        rows.append(row)
        if args.results is not None:
            append_json_line(args.results, row)
        print(describe(seed, row), flush=True)
    return rows
