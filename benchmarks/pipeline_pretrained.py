"""SmolLM2-135M-Instruct as pipeline stages: real `serve` and `drive` processes, a stage lost and rebuilt.

For each --stages S and --recovery R: S `swarm-node serve` processes on 127.0.0.1 (one a stage of
SmolLM2's 30 decoder layers, each loaded from the converted preset and cut to its layers), a warm
spare (`serve --stage spare`) and a `swarm-node drive`, all on configs/pipeline.yaml with the
model set to the preset, train on the offline English-text corpus (the LM objective) at the
pretrained model's learning rate. At --fail-at the only server of stage --fail-stage is killed
(SIGKILL, its state folder deleted) and the spare takes the stage over: rebuilt from its
neighbours by CheckFree (CheckFree+ for an end stage), or re-initialised at random (the baseline).
Reported per run: the driver's step time before the failure, the training loss before it (mean of
the 3 steps before), its spike after the recovery (the largest of the 3 steps after), the steps
until the loss is back within 5 % of before, the recovery's seconds as the driver measured them,
and the validation loss at the end. On a pretrained model a random stage should cost far more than
on a model trained from scratch for a few hundred steps; this measures by how much. One seed a
run, the same corpus and failure step for every method. Ends with one JSON line.

    .venv/bin/python benchmarks/pipeline_pretrained.py --stages 4 --recovery checkfree random --steps 14 \\
        --fail-at 6 --set pipeline.checkfree_plus=false --results benchmarks/results/pipeline_pretrained.jsonl
    .venv/bin/python benchmarks/pipeline_pretrained.py --stages 2 --recovery checkfree --steps 14 --fail-at 6 \\
        --results benchmarks/results/pipeline_pretrained.jsonl     # the shipped CheckFree+ (an end stage)

CheckFree+ trains with out-of-order micro-batches (stages swapped on every other one) so that an end stage can be
copied from its neighbour: a pretrained model's swapped micro-batches run its layers in an order it never saw, and
their loss lifts the training loss far above the validation loss. --set pipeline.checkfree_plus=false trains in
order (a middle stage is rebuilt by CheckFree either way).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import print_result_line, read_json_lines  # noqa: E402

SWARM_NODE = str(REPO / ".venv" / "bin" / "swarm-node")
START_S = 900.0  # a server loads the 538 MB float32 preset and cuts its stage out: minutes on a loaded machine


def settings(values: list[str]) -> list[str]:
    return [arg for value in values for arg in ("--set", value)]


def rows_of(state_dir: Path) -> list[dict]:
    return read_json_lines(state_dir / "metrics.jsonl")


def wait(condition, timeout_s: float, what: str, procs: list[subprocess.Popen]):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for proc in procs:
            if proc.poll() is not None:
                raise SystemExit(f"a process exited with {proc.returncode} while waiting for {what}: {proc.args}")
        value = condition()
        if value:
            return value
        time.sleep(1.0)
    raise SystemExit(f"timed out after {timeout_s:.0f} s waiting for {what}")


def serving(state_dir: Path) -> bool:
    """Whether the server has acquired its stage's weights (each acquisition is a line of recoveries.jsonl)."""
    path = state_dir / "recoveries.jsonl"
    return path.exists() and bool(path.read_text().strip())


class Run:
    def __init__(self, scratch: Path, overrides: list[str], env: dict[str, str]):
        self.scratch, self.overrides, self.env = scratch, overrides, env
        self.procs: dict[str, subprocess.Popen] = {}
        self.address: str | None = None

    def start(self, name: str, command: list[str]) -> subprocess.Popen:
        state = self.scratch / name
        argv = [SWARM_NODE, *command, "--config", "configs/pipeline.yaml", "--state-dir", str(state)]  # a new folder
        if self.address:
            argv += ["--initial-peers", self.address]
        out = open(self.scratch / f"{name}.out", "w")
        self.procs[name] = subprocess.Popen(
            argv + settings(self.overrides), stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=self.env,
            start_new_session=True,
        )  # fmt: skip
        return self.procs[name]

    def kill(self, name: str) -> None:
        os.killpg(self.procs[name].pid, signal.SIGKILL)
        self.procs[name].wait(timeout=60)
        shutil.rmtree(self.scratch / name, ignore_errors=True)  # nothing the dead server wrote may help its successor

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGINT)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


def one_run(args, stages: int, recovery: str) -> dict:
    scratch = Path(tempfile.mkdtemp(prefix=f"pipeline-pretrained-{stages}-{recovery}-"))
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    overrides = [
        "model.name_or_path=smollm2-135m-instruct",
        f"pipeline.num_stages={stages}",
        f"pipeline.recovery={recovery}",
        f"pipeline.lr={args.lr}",
        f"pipeline.micro_batch_size={args.micro_batch}",
        f"pipeline.micro_batches={args.micro_batches}",
        f"pipeline.sequence_length={args.sequence_length}",
        "pipeline.validation_sequences=16",
        f"pipeline.eval_every={args.steps}",
        f"swarm.swarm_id=pretrained-{stages}-{recovery}-{os.getpid()}",
        # a stage of SmolLM2 on a loaded 2-core machine answers slower than the demo's tiny stages
        "pipeline.call_timeout_s=120",
        "pipeline.announce_ttl_s=30",
        "pipeline.rebalance=false",
        "torch_threads=1",
        *args.set,
    ]
    run = Run(scratch, overrides, env)
    try:
        first = run.start("s0", ["serve", "--stage", "0"])
        addresses = scratch / "s0" / "addresses.txt"
        run.address = wait(
            lambda: addresses.exists() and addresses.read_text().split()[:1], START_S, "server 0's address", [first]
        )[0]
        for stage in range(1, stages):
            run.start(f"s{stage}", ["serve", "--stage", str(stage)])
        wait(
            lambda: all(serving(scratch / f"s{i}") for i in range(stages)),
            START_S,
            "every stage server to serve",
            list(run.procs.values()),
        )
        spare = run.start("spare", ["serve", "--stage", "spare"])
        driver = run.start("driver", ["drive"])
        driver_dir = scratch / "driver"
        wait(lambda: len(rows_of(driver_dir)) >= args.fail_at, START_S * 2, f"step {args.fail_at}", [spare, driver])
        failed_after = len(rows_of(driver_dir))
        run.kill(f"s{args.fail_stage}")
        wait(lambda: len(rows_of(driver_dir)) >= args.steps, START_S * 2, f"step {args.steps}", [spare, driver])
        rows = rows_of(driver_dir)
    finally:
        run.stop()
    before = [r["loss"] for r in rows[failed_after - 3 : failed_after]]
    after = rows[failed_after:]
    loss_before = sum(before) / len(before)
    back = next((i + 1 for i, r in enumerate(after) if r["loss"] <= 1.05 * loss_before), None)
    recoveries = [event for r in rows for event in r.get("recovery", [])]
    validation = [r["val_loss"] for r in rows if "val_loss" in r]
    result = {
        "stages": stages,
        "recovery": recovery,
        "steps": len(rows),
        "failed_after_step": failed_after,
        "step_s_before": sorted(r["step_s"] for r in rows[1:failed_after])[(failed_after - 1) // 2],
        "loss_first": rows[0]["loss"],
        "loss_before_failure": loss_before,
        "loss_spike": max(r["loss"] for r in after[:3]),
        "steps_back_within_5pct": back,
        "loss_last": rows[-1]["loss"],
        "val_loss_end": validation[-1] if validation else None,
        "recovery_s": [e.get("recovery_s") for e in recoveries],
        "losses": [round(r["loss"], 4) for r in rows],
        "logs": str(scratch),
    }
    print(
        f"{stages} stages, {recovery}: loss {result['loss_first']:.3f} -> {loss_before:.3f} before the failure, "
        f"spike {result['loss_spike']:.3f}, back within 5 % after {back} steps, last {result['loss_last']:.3f}; "
        f"step {result['step_s_before']:.1f} s, recovery {result['recovery_s']}",
        flush=True,
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--recovery", nargs="+", default=["checkfree", "random"], choices=["checkfree", "random"])
    parser.add_argument("--steps", type=int, default=24, help="driver steps a run")
    parser.add_argument("--fail-at", type=int, default=8, help="the stage server is killed after this many steps")
    parser.add_argument("--fail-stage", type=int, default=1, help="the stage whose only server is killed")
    parser.add_argument("--lr", type=float, default=3e-5, help="a pretrained model's, not the from-scratch demo's")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--sequence-length", type=int, default=64)
    parser.add_argument("--set", action="append", default=[], help="more config overrides of every process")
    parser.add_argument("--results", type=Path, default=None, help="also append the JSON line here")
    args = parser.parse_args()
    if not 3 < args.fail_at < args.steps:
        parser.error("--fail-at must leave 3 steps before it and at least one after it")
    runs = [one_run(args, stages, recovery) for stages in args.stages for recovery in args.recovery]
    line = {
        "benchmark": "pipeline_pretrained",
        "date": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()),
        "model": "smollm2-135m-instruct",
        "settings": {k: v for k, v in vars(args).items() if k != "results"},
        "runs": runs,
        "load_average": os.getloadavg(),
    }
    print_result_line(line, args.results)


if __name__ == "__main__":
    main()
