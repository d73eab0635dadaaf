"""What every mode of benchmarks/pipeline_throughput.py runs the pipeline on: the model sizes, the model in one
process, split in process (no wire), and through `serve` processes on loopback with their calls timed."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from types import SimpleNamespace

import torch

from benchmarks.common import REPO
from node.config import NodeConfig
from node.pipeline.backend import StageBackend
from node.pipeline.corpus import micro_batch
from node.pipeline.driver import PipelineRouter
from node.pipeline.handler import COMPUTE_WORK, StageHandler
from node.pipeline.lm import LMDriver, full_masks, lm_loss
from node.pipeline.stages import (
    PipelineStage,
    StagePlan,
    extra_parts_for,
    pipeline_limits,
    stage_plan,
)
from node.state import StateStore

# name -> (hidden, decoder layers, heads, MLP width); parameters counted at run time (the char vocabulary is 100)
SIZES = {
    "0.34M": (64, 8, 2, 128),  # stage_recovery's pipeline model
    "5M": (256, 8, 4, 512),
    "27M": (512, 8, 8, 1536),  # about 1 s per 512-token micro-batch on one thread of this machine
}
TINY = {"tiny": (32, 4, 2, 64)}
START_S = 300  # a server imports torch and hivemind and starts p2pd: generous on a loaded 2-core machine


def shape_overrides(shape: tuple[int, int, int, int]) -> list[str]:
    """The default model at `shape` (a SIZES value), untrained: the settings both pipeline benchmarks build it with."""
    hidden, layers, heads, intermediate = shape
    return [
        f"model.default.hidden_size={hidden}",
        f"model.default.num_layers={layers}",
        f"model.default.num_heads={heads}",
        f"model.default.intermediate_size={intermediate}",
        "model.default.warmup_steps=0",
    ]


def overrides(shape: tuple[int, int, int, int], stages: int, swarm_id: str, settings: list[str]) -> list[str]:
    return [
        *shape_overrides(shape),
        f"pipeline.num_stages={stages}",
        f"swarm.swarm_id={swarm_id}",
        'swarm.host_maddrs=["/ip4/127.0.0.1/tcp/0"]',
        "swarm.bootstrap_backoff_s=0.5",
        "pipeline.eval_every=0",
        "pipeline.corpus_sequences=256",
        "pipeline.validation_sequences=8",
        "pipeline.announce_interval_s=1",
        "pipeline.announce_ttl_s=30",  # a server starved by the load must not look gone mid-run
        "pipeline.call_timeout_s=120",
        "torch_threads=1",  # every stage server, and this process's own torch work
        *settings,
    ]


def tokens_per_step(config: NodeConfig) -> int:
    p = config.pipeline
    return p.micro_batches * p.micro_batch_size * p.sequence_length


ATTEMPT_ID = re.compile(r"^(s\d+-m\d+)-a(\d+)-")


class Calls:
    """Every call of a way: op, hop, seconds, tensor payload bytes out (to the server) and in (back)."""

    def __init__(self) -> None:
        self.rows: list[dict] = []

    def record(self, call, result, seconds: float) -> None:
        hop = call.call_id.rsplit("-", 1)[-1] if call.op in ("forward", "backward") else "-"
        # LMDriver's call ids: s<step>-m<micro-batch>-a<attempt>-<ns>-<hop>; a micro-batch whose route broke is sent
        # again as the next attempt, and the calls its broken attempt completed moved bytes the shapes do not imply
        attempt = ATTEMPT_ID.match(call.call_id)
        self.rows.append(
            {
                "op": call.op,
                "stage": call.stage,
                "hop": hop,
                "micro_batch": attempt.group(1) if attempt else call.call_id,
                "attempt": int(attempt.group(2)) if attempt else 0,
                "parts": "+".join(call.parts),
                "s": seconds,
                "out": sum(len(t.data) for t in call.tensors.values()),
                "in": sum(len(t.data) for t in result.tensors.values()),
            }
        )


class TimedRouter(PipelineRouter):
    """The real router over p2p streams, timing each call."""

    def __init__(self, *args, calls: Calls, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls = calls

    async def call(self, server, call, timeout=None):
        started = time.perf_counter()
        result = await super().call(server, call, timeout)
        self.calls.record(call, result, time.perf_counter() - started)
        return result


class LocalRouter(PipelineRouter):
    """The router with each stage a `StageHandler` in this process: the same calls, no bytes on a wire."""

    def __init__(self, config: NodeConfig, handlers: list[StageHandler], fingerprints: list[str], calls: Calls):
        super().__init__(None, config, "local", fingerprints, handlers[0].limits)
        self.handlers = handlers
        self.calls = calls
        self.servers = {i: SimpleNamespace(stage=i, node_id=f"local-{i}") for i in range(len(handlers))}
        # op -> the torch work's wall seconds and its COMPUTE_WORK, summed over every stage, as a server counts them
        self.work: defaultdict[str, Counter] = defaultdict(Counter)

    async def pick_route(self, hops):
        return {stage: self.servers[stage] for stage, _ in hops}

    async def call(self, server, call, timeout=None):
        started = time.perf_counter()
        timing: dict[str, float] = {}
        result = await self.handlers[server.stage].serve("driver", call, timing)
        self.calls.record(call, result, time.perf_counter() - started)
        work = self.work[call.op]
        for key in ("compute", *COMPUTE_WORK):
            work[key] += timing.get(key, 0)
        work["calls"] += 1
        return result


def local_handlers(config: NodeConfig, model, fingerprints: list[str]) -> list[StageHandler]:
    plan = stage_plan(config, model.config)
    limits = pipeline_limits(config, model.config, sum(p.numel() for p in model.parameters()))
    handlers = []
    for index in range(plan.num_stages):
        stage = PipelineStage.from_model(model, plan, index, extra_parts=extra_parts_for(config, index))
        handler = StageHandler(limits)
        handler.backend = StageBackend(config.pipeline, model.config, plan, stage)
        handler.fingerprint = fingerprints[index]
        handler.state = "serving"
        handlers.append(handler)
    return handlers


class OneProcess:
    """The whole model trained in this process on the driver's micro-batches: the baseline.

    `untied` gives the LM head its own copy of a tied embedding, and `clip_stages` S clips each of S stages' gradients
    apart (stage_plan's split), as a pipeline's servers do: `--loss-check` measures what each costs the pipeline."""

    def __init__(
        self, config: NodeConfig, model, corpus: torch.Tensor, threads: int, untied: bool = False, clip_stages: int = 0
    ) -> None:
        self.config, self.model, self.corpus, self.threads = config, model, corpus, threads
        p = config.pipeline
        if untied and model.lm_head.weight is model.get_input_embeddings().weight:
            model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
            model.config.tie_word_embeddings = False
        self.clip_groups = (
            stage_parameters(model, StagePlan(model.config.num_hidden_layers, clip_stages)) if clip_stages else []
        )
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=p.lr, weight_decay=p.weight_decay)
        self.step = 0

    def train_step(self) -> dict:
        torch.set_num_threads(self.threads)
        try:
            return self._train_step()
        finally:
            torch.set_num_threads(self.config.torch_threads)

    def _train_step(self) -> dict:
        p = self.config.pipeline
        started = time.perf_counter()
        self.step += 1
        losses = []
        for index in range(p.micro_batches):
            input_ids = micro_batch(self.corpus, self.step, index, p.micro_batch_size)
            positions, mask = full_masks(input_ids)
            logits = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions).logits
            loss = lm_loss(logits, input_ids)
            (loss / p.micro_batches).backward()
            losses.append(loss.item())
        for group in self.clip_groups or [list(self.model.parameters())]:
            torch.nn.utils.clip_grad_norm_(group, p.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"loss": sum(losses) / len(losses), "step_s": time.perf_counter() - started}

    def validation_loss(self, validation: torch.Tensor) -> float:
        """Mean loss over `validation` in micro-batches, without graphs (as LMDriver.validation_loss)."""
        size, total = self.config.pipeline.micro_batch_size, 0.0
        with torch.no_grad():
            for start in range(0, validation.shape[0], size):
                input_ids = validation[start : start + size]
                positions, mask = full_masks(input_ids)
                logits = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions).logits
                total += float(lm_loss(logits, input_ids)) * input_ids.shape[0]
        return total / validation.shape[0]


def stage_parameters(model, plan: StagePlan) -> list[list[torch.nn.Parameter]]:
    """The whole model's parameters as `plan`'s stages own them: the embedding with stage 0's layers, the final norm
    and the LM head with the last stage's (the parameter a tied model shares would be in both: untie it first)."""
    decoder = model.model
    groups = [[p for i in plan.layer_range(s) for p in decoder.layers[i].parameters()] for s in range(plan.num_stages)]
    groups[0][:0] = decoder.embed_tokens.parameters()
    groups[-1] += [*decoder.norm.parameters(), *model.lm_head.parameters()]
    grouped = [id(p) for group in groups for p in group]
    if len(grouped) != len(set(grouped)) or set(grouped) != {id(p) for p in model.parameters()}:
        raise ValueError("the stages' parameters must be the model's, each once (is the embedding still tied?)")
    return groups


class Servers:
    """S `swarm-node serve` processes of one pipeline, each in its own process group (ended by its own id)."""

    def __init__(
        self, root: Path, config_overrides: list[str], stages: int, more: list[tuple[str, list[str]]] = ()
    ) -> None:
        """Servers of stages 0..stages-1 (each joined to the first), then one per (stage or 'spare', its peers) of
        `more`."""
        self.root = root
        self.procs: list[subprocess.Popen] = []
        self.logs = []
        args = ["--config", str(REPO / "configs" / "pipeline.yaml")]
        for setting in config_overrides:
            args += ["--set", setting]
        specs = [(str(i), None) for i in range(stages)] + list(more)
        try:
            for index, (stage, peers) in enumerate(specs):
                state_dir = root / f"server-{index}"
                command = [sys.executable, "-m", "node.cli", "serve", *args, "--state-dir", str(state_dir)]
                command += ["--stage", stage]
                peers = peers or (self.addresses(0) if index else [])
                if peers:
                    command += ["--initial-peers", *peers]
                log = open(root / f"server-{index}.out", "w")
                self.logs.append(log)
                self.procs.append(
                    subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
                )
                self.addresses(index)
        except BaseException:  # a server that never joined, or Ctrl-C: the caller never gets this object to close
            self.close()
            raise

    def addresses(self, index: int) -> list[str]:
        path = self.root / f"server-{index}" / "addresses.txt"
        self._wait(lambda: path.exists() and path.read_text().split(), index, "to join")
        return path.read_text().split()

    def wait_serving(self) -> None:
        for index in range(len(self.procs)):
            if "spare" in self.procs[index].args:
                continue
            self._wait(lambda: (self.root / f"server-{index}" / "recoveries.jsonl").exists(), index, "to serve")

    def _wait(self, ready, index: int, what: str) -> None:
        deadline = time.monotonic() + START_S
        while not ready():
            if self.procs[index].poll() is not None:
                raise RuntimeError(f"server {index} exited: {(self.root / f'server-{index}.out').read_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"server {index} did not manage {what} in {START_S}s")
            time.sleep(0.2)

    def served(self, after: float) -> list[dict]:
        """Each server's `call_seconds` (node/pipeline/handler.py: op -> phase -> seconds) from a stage.json it wrote
        after the unix time `after` (a server rewrites it every announce interval)."""
        return served_since([self.root / f"server-{i}" for i in range(len(self.procs))], after, self._wait)

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
        for log in self.logs:
            log.close()


def served_since(state_dirs: list[Path], after: float, wait) -> list[dict]:
    """Each server's `call_seconds` from the stage.json it wrote after the unix time `after`; `wait(ready, index,
    what)` waits until `ready()` or fails when server `index` is gone."""
    snapshots = []
    for index, state_dir in enumerate(state_dirs):
        path = state_dir / "stage.json"
        wait(lambda: path.exists() and path.stat().st_mtime > after, index, "to write its counters")
        snapshots.append(json.loads(path.read_text())["call_seconds"])
    return snapshots


def swarm_slug(text: str) -> str:
    """`text` as a swarm id may hold it."""
    return "".join(c if c.isalnum() or c in "._-" else "-" for c in text)


def copy_model(model):
    import copy

    return copy.deepcopy(model)


def fresh_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def lm_driver(config: NodeConfig, router, corpus, state_dir: Path, validation: torch.Tensor | None = None) -> LMDriver:
    """An LMDriver over `router` with a fresh state dir; `validation` for runs that validate (else a placeholder)."""
    return LMDriver(
        config, router, corpus, corpus[:1] if validation is None else validation, StateStore(fresh_dir(state_dir))
    )


async def runner_step(runner) -> dict:
    if isinstance(runner, OneProcess):
        return await asyncio.to_thread(runner.train_step)
    return await runner.train_step()
