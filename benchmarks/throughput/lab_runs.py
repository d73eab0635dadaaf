"""--lab MBIT: every process of the pipeline in its own namespace of the lab (benchmarks/lab/, root) on shaped
links, optionally beside checkpoint uploads (--lab-uploads)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from benchmarks.checkpoint_store import STORE_PORT
from benchmarks.common import REPO
from benchmarks.lab import Lab, Link
from benchmarks.throughput.calls import server_ms_per_call
from benchmarks.throughput.harness import (
    START_S,
    OneProcess,
    fresh_dir,
    overrides,
    served_since,
    swarm_slug,
    tokens_per_step,
)
from node.config import load_config
from node.device import HOST
from node.model import resolve_initial_policy
from node.pipeline.corpus import training_corpus
from node.pipeline.handler import CALL_PHASES


def lab_run(
    name: str,
    shape,
    stages: int,
    settings: list[str],
    variants: dict[str, list[str]],
    rates: list[float],
    steps: int,
    root: Path,
    upload_mb: float = 0.0,
) -> dict:
    """The size through `stages` servers and a `swarm-node drive`, each process in its own namespace of the lab
    (benchmarks/lab/, root) with every link shaped to each of `rates` Mbit/s both ways; for the plain settings and
    each variant. A variant's server settings (those not starting with `driver:`) start servers of their own.
    The driver's step_s from its metrics, its first step left out; the one-process baseline measured here before.

    With `upload_mb`, every way runs a second time while each server's host uploads a file of that size to a store
    (a lab node of its own, its link unshaped: storage in a data centre) again and again, over the same uplink as
    its hidden states: checkpoint uploads in the background, which stage_recovery gives links of their own. Before
    the pipeline starts at each rate, the hosts upload once at the same time with nothing else on their links, for
    the time an upload takes alone."""
    config = load_config(REPO / "configs" / "pipeline.yaml", overrides(shape, 1, "lab-baseline", settings))
    torch.set_num_threads(config.torch_threads)
    torch.manual_seed(config.seed)
    model, tokenizer = resolve_initial_policy(config, None, HOST)
    one = OneProcess(config, model, training_corpus(config, tokenizer), config.torch_threads)
    one.train_step()
    one_s = statistics.median(one.train_step()["step_s"] for _ in range(steps))
    result = {"one_process_step_s": one_s, "tokens_per_step": tokens_per_step(config), "runs": []}
    print(f"lab {name}: one process {one_s:.2f} s a step", flush=True)
    by_servers: dict[tuple, list[tuple[str, list[str]]]] = defaultdict(list)
    for variant, more in {"plain": [], **variants}.items():
        server_side = tuple(m for m in more if not m.startswith("driver:"))
        by_servers[server_side].append((variant, [m.removeprefix("driver:") for m in more if m.startswith("driver:")]))
    for group, (server_side, drivers) in enumerate(by_servers.items()):
        sets = overrides(shape, stages, f"lab-{swarm_slug(name)}-{group}-{os.getpid()}", settings + list(server_side))
        sets = [s for s in sets if not s.startswith("swarm.host_maddrs")]
        args = ["--config", str(REPO / "configs" / "pipeline.yaml")] + [a for s in sets for a in ("--set", s)]
        with Lab(stages + (2 if upload_mb else 1), host_link=False) as lab, Uploads(lab, stages, upload_mb) as uploads:
            scratch = fresh_dir(root / f"lab-{name}-{group}")

            def command(index: int, what: list[str], state: Path, peers: list[str]) -> subprocess.Popen:
                argv = [sys.executable, "-m", "node.cli", *what, *args, "--state-dir", str(state)]
                argv += ["--set", f'swarm.host_maddrs=["/ip4/{lab.ip(index)}/tcp/0"]']
                if peers:
                    argv += ["--initial-peers", *peers]
                return lab.run(index, argv, state.parent / f"{state.name}.out")

            bootstrap: list[str] = []
            for index in range(stages):
                state = scratch / f"server-{index}"
                command(index, ["serve", "--stage", str(index)], state, bootstrap)
                _wait_path(state / "addresses.txt", lab, index)
                bootstrap = bootstrap or (state / "addresses.txt").read_text().split()[:1]
            for index in range(stages):
                _wait_path(scratch / f"server-{index}" / "recoveries.jsonl", lab, index)
            server_dirs = [scratch / f"server-{index}" for index in range(stages)]

            def wait(ready, index: int, what: str) -> None:
                wait_lab_node(ready, lab, index, what, scratch / f"server-{index}.out")

            def drive(rate: float, variant: str, driver_sets: list[str], uploading: bool) -> dict:
                state = scratch / (f"driver-{rate}-{variant}" + ("-uploading" if uploading else ""))
                extra = [a for s in driver_sets for a in ("--set", s)]
                served_before = served_since(server_dirs, time.time(), wait)
                command(stages, ["drive", "--steps", str(steps + 1), *extra], state, bootstrap)
                deadline = time.monotonic() + 1800
                while lab.alive(stages) and time.monotonic() < deadline:
                    time.sleep(1)
                if lab.alive(stages):
                    lab.kill(stages)
                # every step's calls, the untimed first step's too: the phases are per call, not per step
                server_ms = server_ms_per_call(served_before, served_since(server_dirs, time.time(), wait))
                rows = [json.loads(line) for line in (state / "metrics.jsonl").read_text().splitlines()]
                step_s = statistics.median(row["step_s"] for row in rows[1:])
                return {
                    "variant": variant,
                    "settings": list(server_side) + driver_sets,
                    "mbit": rate,
                    "uploading": uploading,
                    "step_s": step_s,
                    "tokens_per_s": tokens_per_step(config) / step_s,
                    "vs_one_process": one_s / step_s,
                    "loss_last": rows[-1]["loss"],
                    "steps": len(rows) - 1,
                    "server_ms_per_call": server_ms,
                }

            for rate in rates:
                for index in range(stages + 1):
                    lab.shape(index, Link(mbit=rate))
                if upload_mb and group == 0:
                    result.setdefault("upload_alone_s", {})[f"{rate:g}"] = uploads.once()
                    print(
                        f"lab {name} {rate:g} Mbit/s: {upload_mb:g} MB uploaded from each of {stages} hosts at once, "
                        f"alone on their links: {_seconds(result['upload_alone_s'][f'{rate:g}'])}",
                        flush=True,
                    )
                for variant, driver_sets in drivers:
                    for uploading in (False, True) if upload_mb else (False,):
                        if uploading:
                            uploads.start()
                        try:
                            run = drive(rate, variant, driver_sets, uploading)
                        finally:
                            if uploading:
                                run_uploads = uploads.stop()
                        if uploading:
                            plain = next(
                                r
                                for r in result["runs"]
                                if r["variant"] == variant and r["mbit"] == rate and not r["uploading"]
                            )
                            run.update(upload_s=run_uploads, step_vs_without_uploads=run["step_s"] / plain["step_s"])
                        result["runs"].append(run)
                        label = variant + (" +uploads" if uploading else "")
                        print(
                            f"lab {name} S={stages} {rate:g} Mbit/s {label:<18}: "
                            f"{run['step_s']:.2f} s a step, {run['tokens_per_s']:.0f} tokens/s, "
                            f"{run['vs_one_process']:.2f}x one process"
                            + (
                                f", {run['step_vs_without_uploads']:.2f}x the step without uploads; uploads beside "
                                f"it {_seconds(run['upload_s'])}"
                                if uploading
                                else ""
                            ),
                            flush=True,
                        )
                        for op, split in run["server_ms_per_call"].items():
                            phases = ", ".join(f"{phase} {split[phase]:.1f}" for phase in CALL_PHASES)
                            print(
                                f"  on the servers, a {op} call (ms): {phases}; compute's CPU "
                                f"{split['compute_cpu']:.1f}",
                                flush=True,
                            )
    return result


def _seconds(values: list[float]) -> str:
    if not values:
        return "none finished"
    return f"{statistics.fmean(values):.1f} s on the mean ({min(values):.1f}-{max(values):.1f}, {len(values)} uploads)"


class Uploads:
    """--lab-uploads: each server host's uploads of a file of `mb` MB to a store on lab node `stages + 1`, by processes
    in the hosts' namespaces (benchmarks/checkpoint_store.py --upload-loop), stopped by their process groups."""

    def __init__(self, lab, stages: int, mb: float) -> None:
        self.lab, self.stages, self.mb = lab, stages, mb
        self.processes: list[subprocess.Popen] = []
        self.logs: list[Path] = []
        self.round = 0

    def __enter__(self) -> "Uploads":
        if not self.mb:
            return self
        self.scratch = Path(tempfile.mkdtemp(prefix="lab-uploads-"))
        try:
            self.file = self.scratch / "checkpoint.pt"
            self.file.write_bytes(os.urandom(int(self.mb * 1e6)))
            self.store_ip = self.lab.ip(self.stages + 1)
            self.lab.run(
                self.stages + 1,
                [sys.executable, str(REPO / "benchmarks" / "checkpoint_store.py"), str(self.scratch / "store"),
                 self.store_ip, str(STORE_PORT)],
                self.scratch / "store.out",
            )  # fmt: skip
            for _ in range(600):
                if self.lab.dial(0, self.store_ip, STORE_PORT):
                    return self
                time.sleep(0.1)
            raise RuntimeError(f"the lab's checkpoint store never listened: {self.scratch / 'store.out'}")
        except BaseException:
            self.__exit__()
            raise

    def start(self) -> None:
        self.round += 1
        self.logs = [self.scratch / f"uploads-{self.round}-{index}.log" for index in range(self.stages)]
        for index, log in enumerate(self.logs):
            argv = [sys.executable, str(REPO / "benchmarks" / "checkpoint_store.py"), "--upload-loop", str(self.file)]
            argv += [self.store_ip, str(STORE_PORT), str(log)]
            with open(self.scratch / f"uploader-{index}.out", "ab") as out:
                self.processes.append(
                    subprocess.Popen(
                        ["ip", "netns", "exec", self.lab.ns(index), *argv],
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        cwd=REPO,
                        start_new_session=True,
                    )
                )

    def stop(self) -> list[float]:
        """Stop every uploader; the seconds of each upload that ended (one cut by the stop is not counted)."""
        for process in self.processes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):  # SIGKILL: it goes; a stuck wait must not hide why
                process.wait(timeout=30)
        self.processes = []
        return [float(line) for log in self.logs if log.exists() for line in log.read_text().split()]

    def once(self) -> list[float]:
        """Every host uploads once, at the same time, with nothing else on its link: each host's seconds."""
        self.start()
        try:
            deadline = time.monotonic() + 1800
            while not all(log.exists() and log.read_text().strip() for log in self.logs):
                if any(process.poll() is not None for process in self.processes):
                    raise RuntimeError(f"an uploader exited: {self.scratch}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"an upload of {self.mb:g} MB took over 1800 s: {self.scratch}")
                time.sleep(0.5)
        finally:
            self.stop()
        return [float(log.read_text().split()[0]) for log in self.logs]

    def __exit__(self, *exc) -> None:
        if self.processes:
            self.stop()
        if self.mb:
            if self.lab.alive(self.stages + 1):
                self.lab.kill(self.stages + 1)  # the store, before its folder goes
            shutil.rmtree(self.scratch, ignore_errors=True)


def _wait_path(path: Path, lab, index: int) -> None:
    wait_lab_node(path.exists, lab, index, f"to write {path.name}", path.parent.parent / (path.parent.name + ".out"))


def wait_lab_node(ready, lab, index: int, what: str, log: Path) -> None:
    deadline = time.monotonic() + START_S
    while not ready():
        if not lab.alive(index):
            raise RuntimeError(f"lab node {index} exited while waiting {what}: {log}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"lab node {index} did not manage {what} in {START_S}s")
        time.sleep(0.2)
