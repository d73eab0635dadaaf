"""The default test suite, run N times in a row beside a CPU hog that keeps every core busy.

A test that needs an idle machine to pass is a defect (CI shares its cores with other work):
this is the check of it. Each run is `python -m pytest -q` (the README's test command without
the install step), with `hog` busy-loop processes at the same priority beside it.

    python benchmarks/suite_under_load.py --runs 5            # hog = one busy process per core

Prints each run's outcome, wall time and slowest tests, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HOG = "import os\nwhile True:\n    os.getpid()\n"


def run_suite(extra: list[str]) -> tuple[int, float, str]:
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=8", *extra],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    return proc.returncode, time.monotonic() - started, proc.stdout + proc.stderr


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument(
        "--hog",
        type=int,
        default=os.cpu_count() or 2,
        help="busy-loop processes beside the suite (default: one per core)",
    )
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp/suite-under-load"))
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (e.g. a subset of tests)")
    args = parser.parse_args()
    args.log_dir.mkdir(parents=True, exist_ok=True)
    # a kill of this script still stops its hogs (the finally below)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(args.hog)]
    runs = []
    try:
        for index in range(1, args.runs + 1):
            code, seconds, output = run_suite(args.pytest_args)
            log_path = args.log_dir / f"run-{index}.log"
            log_path.write_text(output)
            summary = next(
                (line for line in reversed(output.splitlines()) if re.search(r"\d+ (passed|failed)", line)),
                "no summary",
            )
            failed = re.findall(r"^FAILED (\S+)", output, flags=re.M)
            runs.append(
                {
                    "run": index,
                    "exit": code,
                    "seconds": round(seconds),
                    "summary": summary.strip("= "),
                    "failed": failed,
                }
            )
            print(
                f"run {index}/{args.runs}: exit {code} in {seconds / 60:.1f} min: {summary.strip('= ')} (log "
                f"{log_path})",
                flush=True,
            )
            for name in failed:
                print(f"    FAILED {name}", flush=True)
    finally:
        for hog in hogs:
            hog.send_signal(signal.SIGKILL)
            hog.wait()
    passed_in_a_row = 0
    for run in runs:
        passed_in_a_row = passed_in_a_row + 1 if run["exit"] == 0 else 0
    print(
        json.dumps(
            {
                "benchmark": "suite_under_load",
                "hog_processes": args.hog,
                "cores": os.cpu_count(),
                "runs": len(runs),
                "passed": sum(r["exit"] == 0 for r in runs),
                "passed_in_a_row_at_end": passed_in_a_row,
                "minutes": [round(r["seconds"] / 60, 1) for r in runs],
                "failed": sorted({f for r in runs for f in r["failed"]}),
            }
        )
    )


if __name__ == "__main__":
    main()
