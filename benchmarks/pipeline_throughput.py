"""What a step through S pipeline stages costs against the same model trained in one process (issue #37).

The language-model objective (node/pipeline/lm.py: `LMDriver`, the fixed offline corpus,
CheckFree+ swaps on odd micro-batches, as `swarm-node drive` runs it) at several model sizes,
each measured four ways side by side, in interleaved rounds so that the machine's load
weighs on every way alike:

- `one_process`: the whole model in this process, no stages, no network: the same
  micro-batches, the same loss, one AdamW step (what a user training it alone gets);
- `local S`: the model cut into S stages, each a real `StageHandler`/`StageBackend` in this
  process, called directly (no bytes on any wire): what the split itself costs, and each
  call's compute, to subtract from the same call over the network;
- `wire S`: S `swarm-node serve` processes on 127.0.0.1 (each its own process, p2p daemon and
  `torch_threads`), driven from this process by a real `PipelineRouter` over p2p streams.

Per way: step time, tokens/s (micro_batches x micro_batch_size x sequence_length per step);
per call of the wire ways, its round trip less the same call's time in the local way of the
same S (`overhead_ms`, by op: forward, backward, step); bytes of tensor payload per
micro-batch, each way (driver -> servers, servers -> driver: hop by hop, every hop goes through the
driver, see node/pipeline/driver.py; with `pipeline.direct_hops` a micro-batch is one chained forward, the collect
of its output and one chained backward, and a chained call has no `overhead_ms`: its round trip holds the hops after
it); and where each wire way's forward and backward calls spent their time
on their servers' own clocks (`server_ms_per_call`: the phases of node/pipeline/handler.py's CALL_PHASES, read
from every server's stage.json), beside the driver's time for the same calls; and what a call's torch work cost
its worker thread, on the servers and in the local way alike (`compute_cpu`, `compute_faults`: CPU ms and minor
page faults a call), so that a server's slower torch work is told apart from waiting. This process takes the
allocator setting its servers take (`pipeline.keep_freed_memory`, node/host_memory.py). Prints its figures and ends
with one JSON line.

Other modes, each instead of the above: `--variant NAME:KEY=VALUE,...` adds a `wire S NAME` way on
servers of its own; `--loss-check STEPS` trains the split in-process with each variant's settings and
compares the losses, with the whole model's in one process beside them (`--loss-check-one-process`: tied, as one
process trains it; its head untied; untied with each stage's gradient clipped apart, as the pipeline's are); `--lab
MBIT ...` runs every process in its own namespace of benchmarks/lab.py (root) on links shaped to each rate (with
`--lab-uploads MB`, each way again while every server's host uploads MB to a store over its own link: checkpoints in
the background beside the hidden states); `--recovery` kills servers and measures the stall per recovery method
(replica failover, a warm spare's checkfree and checkfree_plus);
`--transport-floor` echoes payloads of a call's sizes through two p2p daemons and through plain TCP, with no compute
(the wire's own cost per call, and the CPU it takes in this process and in the daemons; with `--lab`, across two
namespaces on shaped links: what a call costs beyond its payload at the link's rate); `--check-cost` times a server's
check of one received tensor of each of those sizes against the torch check it replaced;
`--protobuf-cost` times a DHT answer and a stream-open request in protobuf's upb and pure-Python implementations.

    .venv/bin/python benchmarks/pipeline_throughput.py                 # the three sizes, S = 2 and 4
    .venv/bin/python benchmarks/pipeline_throughput.py --tiny   # about a minute: tests/test_pipeline_throughput.py
    .venv/bin/python benchmarks/pipeline_throughput.py --sizes 27M --stages 4 \
        --variant bf16:pipeline.wire_dtype=bfloat16 --variant inflight2:pipeline.micro_batches_in_flight=2
    .venv/bin/python benchmarks/pipeline_throughput.py --sizes 5M --stages 4 --loss-check 200 \
        --loss-check-one-process tied untied untied-stage-clip --variant nocfp:pipeline.checkfree_plus=false
    .venv/bin/python benchmarks/pipeline_throughput.py --sizes 27M --recovery
    .venv/bin/python benchmarks/pipeline_throughput.py --transport-floor
    sudo .venv/bin/python benchmarks/pipeline_throughput.py --transport-floor --lab 100 20 --floor-calls 10
    .venv/bin/python benchmarks/pipeline_throughput.py --check-cost
    .venv/bin/python benchmarks/pipeline_throughput.py --protobuf-cost --floor-calls 3000
    .venv/bin/python benchmarks/pipeline_throughput.py --sizes 27M --stages 4 --set pipeline.keep_freed_memory=false
    sudo .venv/bin/python benchmarks/pipeline_throughput.py --sizes 27M --stages 4 --lab 100 20 \
        --variant "bf16+inflight2:pipeline.wire_dtype=bfloat16,driver:pipeline.micro_batches_in_flight=2"
    sudo .venv/bin/python benchmarks/pipeline_throughput.py --sizes 27M --stages 4 --lab 20 --lab-uploads 82 \
        --set pipeline.direct_hops=true --set pipeline.wire_dtype=bfloat16 \
        --set pipeline.micro_batches_in_flight=2
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import enum
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from node.transport import hivemind_p2p  # noqa: E402 - hivemind's private calls, and its protobuf kept isolated

import torch  # noqa: E402

from node.config import NodeConfig, load_config  # noqa: E402
from node.device import HOST  # noqa: E402
from node.host_memory import keep_freed_memory  # noqa: E402
from node.model import model_fingerprint, resolve_initial_policy  # noqa: E402
from node.pipeline.backend import StageBackend  # noqa: E402
from node.pipeline.corpus import micro_batch, training_corpus, validation_corpus  # noqa: E402
from node.pipeline.driver import PipelineRouter  # noqa: E402
from node.pipeline.handler import CALL_PHASES, COMPUTE_WORK, StageHandler  # noqa: E402
from node.pipeline.lm import LMDriver, full_masks, lm_loss  # noqa: E402
from node.pipeline.stagemap import LostReporter  # noqa: E402
from node.pipeline.stages import (  # noqa: E402
    PipelineStage,
    StagePart,
    StagePlan,
    expected_fingerprints,
    extra_parts_for,
    pipeline_limits,
    stage_plan,
)
from node.state import StateStore  # noqa: E402
from node.transport.session import join_swarm  # noqa: E402
from protocol import NodeIdentity  # noqa: E402

from benchmarks.checkpoint_store import STORE_PORT  # noqa: E402

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


PASS_OF_OP = {"forward": "forward", "collect": "forward", "backward": "backward"}


def summarize_calls(rows: list[dict], micro_batches: int) -> dict:
    """Mean seconds by op, and tensor payload bytes per micro-batch, each way (forward and backward calls): those of
    each micro-batch's last attempt (what the shapes imply), and apart those of attempts whose route broke and were
    sent again (`retried_bytes_per_micro_batch`)."""
    by_op: dict[str, list[float]] = defaultdict(list)
    for row in rows:
        by_op[row["op"]].append(row["s"])
    passes = max(1, micro_batches)
    last_attempt: dict[str, int] = {}
    for row in rows:
        last_attempt[row["micro_batch"]] = max(last_attempt.get(row["micro_batch"], 0), row["attempt"])
    final = [r for r in rows if r["attempt"] == last_attempt[r["micro_batch"]]]
    retried = [r for r in rows if r["attempt"] != last_attempt[r["micro_batch"]]]

    def per_micro_batch(chosen: list[dict]) -> dict[str, float]:
        # a chained forward's output comes back by the driver's `collect` of it (pipeline.direct_hops)
        return {
            f"{op}_{way}": sum(r[way] for r in chosen if PASS_OF_OP.get(r["op"]) == op) / passes
            for op in ("forward", "backward")
            for way in ("out", "in")
        }

    hops = sum(1 for r in final if r["op"] == "forward") / passes
    return {
        "calls_s": {op: statistics.fmean(v) for op, v in by_op.items()},
        "calls": {op: len(v) for op, v in by_op.items()},
        "hops_per_micro_batch": hops,
        "bytes_per_micro_batch": per_micro_batch(final),
        "retried_calls": len(retried),
        "retried_bytes_per_micro_batch": per_micro_batch(retried),
    }


def server_ms_per_call(before: list[dict], after: list[dict]) -> dict[str, dict[str, float]]:
    """Where the servers' time went per forward and backward call between two `Servers.served` snapshots: mean ms
    of each phase of node/pipeline/handler.py's CALL_PHASES over every server's calls of that op, and their sum."""

    def total(op: str, key: str) -> float:  # over every server, between the two snapshots
        return sum(a.get(op, {}).get(key, 0) - b.get(op, {}).get(key, 0) for b, a in zip(before, after))

    out = {}
    for op in ("forward", "backward"):
        calls = total(op, "calls")
        if not calls:
            continue
        phases = {phase: 1000 * total(op, phase) / calls for phase in CALL_PHASES}
        out[op] = {
            **phases,
            "total": sum(phases.values()),
            "calls": calls,
            "compute_cpu": 1000 * total(op, "compute_cpu") / calls,
            "compute_faults": total(op, "compute_faults") / calls,
        }
    return out


def compute_per_call(work: dict[str, Counter]) -> dict[str, dict[str, float]]:
    """The in-process way's torch work per forward and backward call (LocalRouter.work), in server_ms_per_call's
    units: wall ms under the lock, its worker thread's CPU ms and minor page faults."""
    out = {}
    for op in ("forward", "backward"):
        calls = work.get(op, {}).get("calls", 0)
        if calls:
            out[op] = {
                "compute": 1000 * work[op]["compute"] / calls,
                "compute_cpu": 1000 * work[op]["compute_cpu"] / calls,
                "compute_faults": work[op]["compute_faults"] / calls,
            }
    return out


def hop_overhead_ms(wire: list[dict], local: list[dict]) -> dict[str, float]:
    """Per op, the mean round trip over the wire less the mean of the same (op, stage, parts) call in-process."""
    local_mean: dict[tuple, list[float]] = defaultdict(list)
    for row in local:
        local_mean[(row["op"], row["stage"], row["parts"])].append(row["s"])
    diffs: dict[str, list[float]] = defaultdict(list)
    for row in wire:
        same = local_mean.get((row["op"], row["stage"], row["parts"]))
        if same:
            diffs[row["op"]].append(row["s"] - statistics.fmean(same))
    return {op: 1000 * statistics.fmean(v) for op, v in diffs.items()}


async def measure_size(
    name: str,
    shape,
    stage_counts: list[int],
    settings: list[str],
    variants: dict[str, list[str]],
    variant_stages: list[int],
    one_process_threads: list[int],
    steps: int,
    rounds: int,
    root: Path,
) -> dict:
    """Every way for one model size, `rounds` interleaved rounds of `steps` steps each (after one warm-up step).
    A variant (name -> more settings) adds a `wire S name` way for each S of `variant_stages`, on servers of its own;
    its overhead is measured against the plain `local S` way."""
    keys = [(1, ""), *((s, "") for s in stage_counts), *((s, v) for v in variants for s in variant_stages)]
    lists = {
        (s, v): overrides(
            shape, s, f"bench-throughput-{name}-s{s}-{_slug(v)}-{os.getpid()}", settings + variants.get(v, [])
        )
        for s, v in keys
    }
    configs = {key: load_config(REPO / "configs" / "pipeline.yaml", lists[key]) for key in lists}
    base = configs[(1, "")]
    torch.set_num_threads(base.torch_threads)
    torch.manual_seed(base.seed)
    model, tokenizer = resolve_initial_policy(base, None, HOST)
    parameters = sum(p.numel() for p in model.parameters())
    fingerprint = model_fingerprint(model, tokenizer)
    corpus = training_corpus(base, tokenizer)
    ways: dict[str, object] = {
        "one_process" + (f" {t} threads" if t != base.torch_threads else ""): OneProcess(base, _copy(model), corpus, t)
        for t in one_process_threads
    }
    calls: dict[str, Calls] = {}
    local_routers: dict[str, LocalRouter] = {}
    servers: dict[str, Servers] = {}
    sessions = []
    try:
        for s in stage_counts:
            config = configs[(s, "")]
            fingerprints = expected_fingerprints(config, model.config, fingerprint)
            calls[f"local {s}"] = Calls()
            router = LocalRouter(config, local_handlers(config, model, fingerprints), fingerprints, calls[f"local {s}"])
            local_routers[f"local {s}"] = router
            ways[f"local {s}"] = _driver(config, router, corpus, root / f"{name}-local-{s}")
        for s, v in keys[1:]:
            way = f"wire {s}" + (f" {v}" if v else "")
            servers[way] = Servers(_fresh(root / f"{name}-{way.replace(' ', '-')}"), lists[(s, v)], s)
        for (s, v), (way, group) in zip(keys[1:], servers.items()):
            group.wait_serving()
            peers = "swarm.initial_peers=" + json.dumps(group.addresses(0))
            config = load_config(REPO / "configs" / "pipeline.yaml", [*lists[(s, v)], peers])
            state_dir = _fresh(root / f"{name}-driver-{way.replace(' ', '-')}")
            session = await join_swarm(config, NodeIdentity.load_or_create(state_dir / "identity.key"), state_dir)
            sessions.append(session)
            calls[way] = Calls()
            fingerprints = expected_fingerprints(config, model.config, fingerprint)
            limits = pipeline_limits(config, model.config, parameters)
            router = TimedRouter(session.dht, config, fingerprint, fingerprints, limits, calls=calls[way])
            await router.wait_until_served()
            ways[way] = _driver(config, router, corpus, state_dir / "run")
        steps_s: dict[str, list[float]] = defaultdict(list)
        losses: dict[str, list[float]] = defaultdict(list)
        for way, runner in ways.items():  # warm-up: first calls open streams, allocate, fill caches
            await _step(runner)
        for record in calls.values():
            record.rows.clear()
        for router in local_routers.values():
            router.work.clear()
        warmed = time.time()
        served_before = {way: group.served(after=warmed) for way, group in servers.items()}
        for _ in range(rounds):
            for way, runner in ways.items():
                for _ in range(steps):
                    row = await _step(runner)
                    steps_s[way].append(row["step_s"])
                    losses[way].append(row["loss"])
        finished = time.time()
        server_ms = {
            way: server_ms_per_call(served_before[way], group.served(after=finished)) for way, group in servers.items()
        }
    finally:
        for session in sessions:
            await session.close()
        for group in servers.values():
            group.close()
    tokens = tokens_per_step(base)
    result = {
        "parameters": parameters,
        "tokens_per_step": tokens,
        "micro_batch": [base.pipeline.micro_batch_size, base.pipeline.sequence_length, model.config.hidden_size],
        "vocab_size": model.config.vocab_size,
        "variants": variants,
        "ways": {},
    }
    one = statistics.median(steps_s["one_process"])
    chained_ways = {f"wire {s}" + (f" {v}" if v else "") for s, v in keys[1:] if configs[(s, v)].pipeline.direct_hops}
    for way, times in steps_s.items():
        median = statistics.median(times)
        entry = {
            "step_s": median,
            "tokens_per_s": tokens / median,
            "vs_one_process": one / median,
            "loss_last": losses[way][-1],
        }
        if way in calls:
            entry.update(summarize_calls(calls[way].rows, base.pipeline.micro_batches * rounds * steps))
        if way in local_routers:
            entry["compute_per_call"] = compute_per_call(local_routers[way].work)
        if way.startswith("wire") and way not in chained_ways:
            # a chained call's round trip holds every hop after it: no one call of the local way compares
            entry["overhead_ms"] = hop_overhead_ms(calls[way].rows, calls["local " + way.split()[1]].rows)
        if way.startswith("wire"):
            entry["server_ms_per_call"] = server_ms[way]
        result["ways"][way] = entry
    return result


# --loss-check's one-process ways: name -> (the head untied from the embedding, each stage's gradient clipped apart)
ONE_PROCESS_WAYS = {"tied": (False, False), "untied": (True, False), "untied-stage-clip": (True, True)}


def loss_check(
    name: str,
    shape,
    stages: int,
    settings: list[str],
    variants: dict[str, list[str]],
    steps: int,
    one_process_ways: tuple[str, ...] = ("tied",),
) -> dict:
    """The training loss of `local S` against each variant's and against the whole model in one process (each of
    `one_process_ways`, with the plain settings), over `steps` steps from the same initial weights on the same
    micro-batches (in this process: the variants that change numbers act in the backends, not on the wire); and each
    one's validation loss after the last step."""
    losses, validation, end_copied = {}, {}, {}
    for variant, more in {"": [], **variants}.items():
        config = load_config(
            REPO / "configs" / "pipeline.yaml",
            overrides(shape, stages, "loss-check", ["pipeline.validation_sequences=64", *settings, *more]),
        )
        torch.manual_seed(config.seed)
        model, tokenizer = resolve_initial_policy(config, None, HOST)
        corpus, held_out = training_corpus(config, tokenizer), validation_corpus(config, tokenizer)
        for way in one_process_ways if not variant else ():  # the micro-batches LMDriver walks: micro_batch(step, i)
            untied, stage_clip = ONE_PROCESS_WAYS[way]
            trainer = OneProcess(
                config, _copy(model), corpus, 1, untied=untied, clip_stages=stages if stage_clip else 0
            )
            key = "one_process" + ("" if way == "tied" else f" {way}")
            losses[key] = [trainer.train_step()["loss"] for _ in range(steps)]
            validation[key] = trainer.validation_loss(held_out)
        fingerprints = expected_fingerprints(config, model.config, model_fingerprint(model, tokenizer))
        router = LocalRouter(config, local_handlers(config, model, fingerprints), fingerprints, Calls())
        with tempfile.TemporaryDirectory() as scratch:
            driver = _driver(config, router, corpus, Path(scratch), held_out)
            way = variant or "plain"
            losses[way] = [asyncio.run(driver.train_step())["loss"] for _ in range(steps)]
            validation[way] = asyncio.run(driver.validation_loss())
            if stages >= 2:
                end_copied[way] = end_stages_copied(router, driver, validation[way])
    tail = max(1, steps // 10)
    # the mean loss over each tenth of the steps (a tenth of fewer than 10 steps is the step it starts at)
    tenths = [slice(steps * k // 10, max(steps * (k + 1) // 10, steps * k // 10 + 1)) for k in range(10)]

    return {
        "size": name,
        "stages": stages,
        "steps": steps,
        "loss_last_tenth": {v: statistics.fmean(curve[-tail:]) for v, curve in losses.items()},
        "loss_first": {v: curve[0] for v, curve in losses.items()},
        "loss_tenths": {v: [statistics.fmean(curve[t]) for t in tenths] for v, curve in losses.items()},
        # after the last step, on pipeline.validation_sequences held-out sequences (64 unless --set)
        "val_loss": validation,
        # the same with the first (then the last) stage's layers replaced by its neighbour's, as CheckFree+ rebuilds it
        "val_loss_end_stage_copied": end_copied,
    }


def end_stages_copied(router: LocalRouter, driver: LMDriver, validation_loss: float) -> dict[str, float]:
    """The validation loss with stage 0's layers replaced by stage 1's, then stage S-1's by stage S-2's, each put back
    after: how good a stand-in CheckFree+'s swaps made the neighbour, at the moment a first or last stage is lost
    (its embedding or head kept, as the neighbour's fresh copy of it would give them back)."""
    stages = [handler.backend.stage for handler in router.handlers]
    out = {}
    for lost, partner in ((0, 1), (len(stages) - 1, len(stages) - 2)):
        own = stages[lost].part_state_dict(StagePart.LAYERS)
        stages[lost].load_part_state_dict(StagePart.LAYERS, stages[partner].part_state_dict(StagePart.LAYERS))
        out[f"stage {lost}"] = asyncio.run(driver.validation_loss())
        stages[lost].load_part_state_dict(StagePart.LAYERS, own)
    if asyncio.run(driver.validation_loss()) != validation_loss:
        raise RuntimeError("the end stages' own layers were not put back")
    return out


def _slug(text: str) -> str:
    """`text` as a swarm id may hold it."""
    return "".join(c if c.isalnum() or c in "._-" else "-" for c in text)


def _copy(model):
    import copy

    return copy.deepcopy(model)


def _fresh(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def _driver(config: NodeConfig, router, corpus, state_dir: Path, validation: torch.Tensor | None = None) -> LMDriver:
    """An LMDriver over `router` with a fresh state dir; `validation` for runs that validate (else a placeholder)."""
    return LMDriver(
        config, router, corpus, corpus[:1] if validation is None else validation, StateStore(_fresh(state_dir))
    )


async def _step(runner) -> dict:
    if isinstance(runner, OneProcess):
        return await asyncio.to_thread(runner.train_step)
    return await runner.train_step()


def print_size(name: str, result: dict) -> None:
    print(
        f"\n{name}: {result['parameters'] / 1e6:.2f}M parameters, {result['tokens_per_step']} tokens per step, "
        f"micro-batch {result['micro_batch']} (B, T, H), vocabulary {result['vocab_size']}"
    )
    print(
        f"{'way':<22} {'step s':>8} {'tokens/s':>9} {'x one':>6} {'hops/mb':>7} {'fwd ms':>7} {'bwd ms':>7} "
        f"{'ovh fwd':>8} {'ovh bwd':>8} {'ovh step':>8} {'MB/mb out':>9} {'MB/mb in':>9}"
    )
    for way, e in result["ways"].items():
        calls = e.get("calls_s", {})
        ovh = e.get("overhead_ms", {})
        moved = e.get("bytes_per_micro_batch", {})
        out = (moved.get("forward_out", 0) + moved.get("backward_out", 0)) / 1e6
        back = (moved.get("forward_in", 0) + moved.get("backward_in", 0)) / 1e6
        print(
            f"{way:<22} {e['step_s']:>8.3f} {e['tokens_per_s']:>9.0f} {e['vs_one_process']:>6.2f} "
            f"{e.get('hops_per_micro_batch', 0):>7.1f} {1000 * calls.get('forward', 0):>7.1f} "
            f"{1000 * calls.get('backward', 0):>7.1f} {ovh.get('forward', math.nan):>8.1f} "
            f"{ovh.get('backward', math.nan):>8.1f} {ovh.get('step', math.nan):>8.1f} {out:>9.3f} {back:>9.3f}"
        )
    for way, e in result["ways"].items():
        for op, split in e.get("server_ms_per_call", {}).items():
            driver_ms = 1000 * e["calls_s"][op]
            print(
                f"  {way}, a {op} call on its server (ms): "
                + ", ".join(f"{phase} {split[phase]:.1f}" for phase in CALL_PHASES)
                + f"; served in {split['total']:.1f} of the driver's {driver_ms:.1f} (the rest: the driver, the "
                f"daemons, the wire, {driver_ms - split['total']:.1f})"
            )
    # the same torch work in this process and on the servers: wall time above the thread's CPU is waiting (for a core,
    # the GIL); more CPU with more page faults is memory taken from the system again
    for way, e in result["ways"].items():
        if not way.startswith("wire"):
            continue
        local = result["ways"].get("local " + way.split()[1], {}).get("compute_per_call", {})
        for op, split in e.get("server_ms_per_call", {}).items():
            if op in local:
                mine = local[op]
                print(
                    f"  torch work of a {op} call, local / {way}: wall ms {mine['compute']:.1f} / "
                    f"{split['compute']:.1f}, thread CPU ms {mine['compute_cpu']:.1f} / {split['compute_cpu']:.1f}, "
                    "minor page faults "
                    f"{mine['compute_faults']:.0f} / {split['compute_faults']:.0f}"
                )


async def recovery_run(name: str, shape, settings: list[str], steps: int, root: Path) -> list[dict]:
    """From a server's death (SIGKILL) to the driver's next successful step, per recovery method, on loopback: 4
    stages and a fifth server (a replica of stage 2 at first; the throughput rule may move a replica), one of the two
    servers of the stage that has two killed (the driver fails over), and a warm spare (`serve --stage spare`, already
    in the DHT) for each kill of every server of a stage: stage 1 (checkfree), then stage 3 (checkfree_plus).
    The shipped announce interval and TTL (configs/pipeline.yaml). Stall = kill -> end of the first step after it,
    less the median normal step; the spare's load time is from its recoveries.jsonl."""
    shipped = load_config(REPO / "configs" / "pipeline.yaml")
    sets = overrides(shape, 4, f"bench-recovery-{name}-{os.getpid()}", settings) + [
        f"pipeline.announce_interval_s={shipped.pipeline.announce_interval_s}",
        f"pipeline.announce_ttl_s={shipped.pipeline.announce_ttl_s}",
        "pipeline.call_timeout_s=20",
    ]
    config0 = load_config(REPO / "configs" / "pipeline.yaml", sets)
    torch.set_num_threads(config0.torch_threads)
    torch.manual_seed(config0.seed)
    model, tokenizer = resolve_initial_policy(config0, None, HOST)
    fingerprint = model_fingerprint(model, tokenizer)
    corpus = training_corpus(config0, tokenizer)
    group = Servers(_fresh(root / f"recovery-{name}"), sets, 4)
    extra: list[Servers] = []
    session = None
    events = []
    try:
        group.wait_serving()
        peers = group.addresses(0)
        extra.append(Servers(_fresh(root / f"recovery-{name}-replica"), sets, 0, more=[("2", peers)]))
        extra[-1].wait_serving()
        config = load_config(REPO / "configs" / "pipeline.yaml", [*sets, "swarm.initial_peers=" + json.dumps(peers)])
        state_dir = _fresh(root / f"recovery-{name}-driver")
        session = await join_swarm(config, NodeIdentity.load_or_create(state_dir / "identity.key"), state_dir)
        fingerprints = expected_fingerprints(config, model.config, fingerprint)
        limits = pipeline_limits(config, model.config, sum(p.numel() for p in model.parameters()))
        router = PipelineRouter(
            session.dht, config, fingerprint, fingerprints, limits, reporter=LostReporter(session, fingerprint)
        )
        while len(router.map.live(2)) < 2:
            await router.refresh(force=True)
            await asyncio.sleep(0.5)
        await router.wait_until_served()
        processes = {  # node id -> the process serving under it
            NodeIdentity.load_or_create(servers.root / f"server-{index}" / "identity.key").node_id: proc
            for servers in [group, *extra]
            for index, proc in enumerate(servers.procs)
        }
        driver = _driver(config, router, corpus, state_dir / "run")
        normal = [(await driver.train_step())["step_s"] for _ in range(steps + 1)][1:]
        step_s = statistics.median(normal)
        for stage, method in ((None, "replica failover"), (1, "checkfree"), (3, "checkfree_plus")):
            spare = None
            if method != "replica failover":
                spare = Servers(_fresh(root / f"recovery-{name}-spare-{stage}"), sets, 0, more=[("spare", peers)])
                extra.append(spare)
                spare.addresses(0)
                spare_id = NodeIdentity.load_or_create(spare.root / "server-0" / "identity.key").node_id
                processes[spare_id] = spare.procs[0]
                while not any(a.node_id == spare_id for a in (await router.refresh(force=True)).spares):
                    await asyncio.sleep(0.5)  # a warm spare: announced before the kill, its start not in the stall
            # Victims by the live map, not by the stage each server started on: the throughput rule moves replicas
            # (2026-11-29: stage 2's first server had moved to another stage, so "killing one of its two replicas"
            # killed its only server, and a replica moving back after rebalance_grace_s made a 10.9 s "failover").
            stage_map = await router.refresh(force=True)
            if stage is None:  # one of the two servers of the stage that has two (5 servers, 4 stages)
                stage = max(range(4), key=lambda s: len(stage_map.live(s)))
                victims = [processes[stage_map.live(stage)[0].node_id]]
            else:  # every server of the stage: it is lost, and only the spare rebuilds it
                victims = [processes[a.node_id] for a in stage_map.live(stage)]
            serving = len(stage_map.live(stage))
            for victim in victims:
                if victim.poll() is None:  # not one killed before whose announcement has not expired yet
                    os.killpg(victim.pid, signal.SIGKILL)
            killed = time.monotonic()
            row = await driver.train_step()
            stall = time.monotonic() - killed - step_s
            loaded = _recoveries(spare.root / "server-0") if spare else []
            event = {
                "method": method,
                "stage": stage,
                "servers_before_kill": serving,
                "stall_s": stall,
                "announce_ttl_s": config.pipeline.announce_ttl_s,
                "announce_interval_s": config.pipeline.announce_interval_s,
                "rebuild_poll_s": config.pipeline.rebuild_poll_s,
                "spare_method": loaded[-1]["method"] if loaded else None,
                "spare_load_s": loaded[-1]["seconds"] if loaded else None,
                "driver_recovery": row.get("recovery"),
                # the driver's wait: found the stage lost -> every stage served again (no step in it)
                "waited_s": next((r["waited_s"] for r in row.get("recovery", []) if r["stage"] == stage), None),
                "retries": row["retries"],
                "normal_step_s": step_s,
            }
            events.append(event)
            print(
                f"recovery {name} {method:<16} stage {stage}: stall {stall:.2f}s (TTL {event['announce_ttl_s']:g}s), "
                f"spare {event['spare_method']} loaded in {event['spare_load_s'] or 0:.2f}s, retries {row['retries']}",
                flush=True,
            )
            for _ in range(2):
                await driver.train_step()
    finally:
        if session is not None:
            await session.close()
        for servers in [group, *extra]:
            servers.close()
    return events


def print_stalls(events: dict[str, list[dict]]) -> dict[str, dict[str, dict[str, float]]]:
    """Print and return the stalls by size, way and method: "size way" -> method -> mean, min, max, n."""
    table: dict[str, dict[str, dict[str, float]]] = {}
    print(
        "| size | way | method | stall s, mean (min-max, n) | driver's wait s, mean (min-max) | spare's load s, mean |"
    )
    print("|---|---|---|---|---|---|")
    for name, rows in events.items():
        for way in dict.fromkeys(row["way"] for row in rows):
            for method in dict.fromkeys(row["method"] for row in rows):
                chosen = [row for row in rows if row["way"] == way and row["method"] == method]
                if not chosen:
                    continue
                stalls = [row["stall_s"] for row in chosen]
                loads = [row["spare_load_s"] for row in chosen if row["spare_load_s"] is not None]
                waits = [row["waited_s"] for row in chosen if row.get("waited_s") is not None]
                figures = {"mean": statistics.mean(stalls), "min": min(stalls), "max": max(stalls), "n": len(stalls)}
                if waits:
                    figures |= {
                        "waited_mean": statistics.mean(waits),
                        "waited_min": min(waits),
                        "waited_max": max(waits),
                    }
                table.setdefault(f"{name} {way}", {})[method] = figures
                waited = f"{statistics.mean(waits):.2f} ({min(waits):.2f}-{max(waits):.2f})" if waits else "-"
                print(
                    f"| {name} | {way} | {method} | {figures['mean']:.2f} ({figures['min']:.2f}-{figures['max']:.2f},"
                    f" {len(stalls)}) | {waited} | {statistics.mean(loads) if loads else 0:.2f} |"
                )
    return table


def _recoveries(state_dir: Path) -> list[dict]:
    path = state_dir / "recoveries.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


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
    (benchmarks/lab.py, root) with every link shaped to each of `rates` Mbit/s both ways; for the plain settings and
    each variant. A variant's server settings (those not starting with `driver:`) start servers of their own.
    The driver's step_s from its metrics, its first step left out; the one-process baseline measured here before.

    With `upload_mb`, every way runs a second time while each server's host uploads a file of that size to a store
    (a lab node of its own, its link unshaped: storage in a data centre) again and again, over the same uplink as
    its hidden states: checkpoint uploads in the background, which stage_recovery gives links of their own. Before
    the pipeline starts at each rate, the hosts upload once at the same time with nothing else on their links, for
    the time an upload takes alone."""
    from lab import Lab, Link

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
        sets = overrides(shape, stages, f"lab-{_slug(name)}-{group}-{os.getpid()}", settings + list(server_side))
        sets = [s for s in sets if not s.startswith("swarm.host_maddrs")]
        args = ["--config", str(REPO / "configs" / "pipeline.yaml")] + [a for s in sets for a in ("--set", s)]
        with Lab(stages + (2 if upload_mb else 1), host_link=False) as lab, Uploads(lab, stages, upload_mb) as uploads:
            scratch = _fresh(root / f"lab-{name}-{group}")

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
                _wait_lab_node(ready, lab, index, what, scratch / f"server-{index}.out")

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
    _wait_lab_node(path.exists, lab, index, f"to write {path.name}", path.parent.parent / (path.parent.name + ".out"))


def _wait_lab_node(ready, lab, index: int, what: str, log: Path) -> None:
    deadline = time.monotonic() + START_S
    while not ready():
        if not lab.alive(index):
            raise RuntimeError(f"lab node {index} exited while waiting {what}: {log}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"lab node {index} did not manage {what} in {START_S}s")
        time.sleep(0.2)


FLOOR_BYTES = [4_096, 65_536, 262_144, 1_048_576, 4_194_304]  # a 4 KB control call to 4 MB (27M's hidden states of a
# micro-batch are 1 MB in float32, its logits' gradient 0.2 MB)


class FloorFrame(enum.IntEnum):
    DATA = 1


def _floor_limit(sizes: list[int]):
    return lambda kind: max(sizes) + 1


async def _floor_echo(reader, writer, sizes: list[int]) -> None:
    from node.transport.framing import read_frame, write_frame

    try:
        _, body = await read_frame(reader, FloorFrame, _floor_limit(sizes))
        await write_frame(writer, FloorFrame.DATA, body)
    finally:
        writer.close()


async def _floor_round_trip(reader, writer, body: bytes, sizes: list[int]) -> None:
    from node.transport.framing import read_frame, write_frame

    try:
        await write_frame(writer, FloorFrame.DATA, body)
        _, back = await read_frame(reader, FloorFrame, _floor_limit(sizes))
    finally:
        writer.close()
    if back != body:  # the figures are only worth something if the bytes came back whole
        raise RuntimeError(f"the echo of {len(body)} bytes came back as {len(back)} different bytes")


async def transport_floor(sizes: list[int], calls: int) -> dict:
    """What a pipeline call's bytes cost on the wire with no compute: a framed echo (node/transport/framing.py, as
    call_stage and StageHandler frame a call) of each size, through two p2p daemons on 127.0.0.1 (a stream per call,
    as call_stage opens one) and through a plain TCP connection on 127.0.0.1 (a connection per call), interleaved call
    by call. Round trip medians, and the CPU seconds per call of this process (both ends' Python) and of the two p2p
    daemons (for the TCP way that is their background work: the DHT's upkeep)."""
    import psutil
    from hivemind.p2p import P2P

    def echo(reader, writer):
        return _floor_echo(reader, writer, sizes)

    def round_trip(reader, writer, body: bytes):
        return _floor_round_trip(reader, writer, body, sizes)

    server = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    client = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=await server.get_visible_maddrs())
    tcp = await asyncio.start_server(echo, "127.0.0.1", 0)
    port = tcp.sockets[0].getsockname()[1]
    await server.add_binary_stream_handler("floor", lambda info, reader, writer: echo(reader, writer))
    daemons = [psutil.Process(hivemind_p2p.daemon_process(p2p).pid) for p2p in (server, client)]

    def daemons_cpu_s() -> float:
        return sum(sum(daemon.cpu_times()[:2]) for daemon in daemons)  # user + system

    rows = {}
    try:
        for size in sizes:
            body = os.urandom(size)
            times: dict[str, list[float]] = {"p2p": [], "tcp": []}
            cpu = {"p2p": [0.0, 0.0], "tcp": [0.0, 0.0]}  # [this process, the two daemons]
            for call in range(calls + 1):  # the first call of each way warms it up and is not counted
                for way in ("p2p", "tcp"):
                    before = (time.process_time(), daemons_cpu_s(), time.perf_counter())
                    if way == "p2p":
                        _, reader, writer = await client.call_binary_stream_handler(server.peer_id, "floor")
                    else:
                        reader, writer = await asyncio.open_connection("127.0.0.1", port)
                    await round_trip(reader, writer, body)
                    wall = time.perf_counter() - before[2]
                    if call:
                        times[way].append(wall)
                        cpu[way][0] += time.process_time() - before[0]
                        cpu[way][1] += daemons_cpu_s() - before[1]
            row = {}
            for way in ("p2p", "tcp"):
                median = statistics.median(times[way])
                row[way] = {
                    "round_trip_ms": 1000 * median,
                    "mb_per_s_each_way": size / median / 1e6,
                    "python_cpu_ms": 1000 * cpu[way][0] / calls,
                    "daemons_cpu_ms": 1000 * cpu[way][1] / calls,
                }
            row["p2p_excess_ms"] = row["p2p"]["round_trip_ms"] - row["tcp"]["round_trip_ms"]
            rows[size] = row
            print(
                f"{size:>9} B  p2p {row['p2p']['round_trip_ms']:7.2f} ms ({row['p2p']['mb_per_s_each_way']:6.0f} MB/s, "
                f"CPU ms: python {row['p2p']['python_cpu_ms']:5.2f}, daemons {row['p2p']['daemons_cpu_ms']:5.2f})  "
                f"tcp {row['tcp']['round_trip_ms']:7.2f} ms ({row['tcp']['mb_per_s_each_way']:6.0f} MB/s, CPU ms: "
                f"python {row['tcp']['python_cpu_ms']:5.2f})  p2p - tcp {row['p2p_excess_ms']:6.2f} ms",
                flush=True,
            )
    finally:
        tcp.close()
        await tcp.wait_closed()
        await client.shutdown()
        await server.shutdown()
    return {"calls": calls, "bytes": rows}


async def floor_peer(role: str, ip: str, addresses: Path, sizes: list[int], calls: int, gap_s: float) -> None:
    """One end of `lab_floor`, run inside a lab namespace. `serve`: a p2p daemon and a TCP server at `ip`, both
    echoing (their addresses written to `addresses`), until killed. `call`: each size `calls` + 1 times (the first
    warms up) through both, interleaved, after `gap_s` of quiet each time (a pipeline call follows a stage's compute,
    and TCP restarts its congestion window after an idle gap); prints one JSON line: size -> way -> seconds."""
    from hivemind.p2p import P2P, PeerID

    if role == "serve":
        server = await P2P.create(host_maddrs=[f"/ip4/{ip}/tcp/0"])
        await server.add_binary_stream_handler("floor", lambda info, reader, writer: _floor_echo(reader, writer, sizes))
        tcp = await asyncio.start_server(lambda reader, writer: _floor_echo(reader, writer, sizes), ip, 0)
        maddrs = [str(m) for m in await server.get_visible_maddrs()]
        ready = {"maddrs": maddrs, "peer_id": server.peer_id.to_base58(), "tcp_port": tcp.sockets[0].getsockname()[1]}
        addresses.with_suffix(".tmp").write_text(json.dumps(ready))
        addresses.with_suffix(".tmp").rename(addresses)
        await asyncio.Event().wait()
    ready = json.loads(addresses.read_text())
    client = await P2P.create(host_maddrs=[f"/ip4/{ip}/tcp/0"], initial_peers=ready["maddrs"])
    server_id = PeerID.from_base58(ready["peer_id"])
    server_ip = ready["maddrs"][0].split("/")[2]
    times: dict[int, dict[str, list[float]]] = {}
    try:
        for size in sizes:
            body = os.urandom(size)
            times[size] = {"p2p": [], "tcp": []}
            for call in range(calls + 1):
                for way in ("p2p", "tcp"):
                    await asyncio.sleep(gap_s)
                    started = time.perf_counter()
                    if way == "p2p":
                        _, reader, writer = await client.call_binary_stream_handler(server_id, "floor")
                    else:
                        reader, writer = await asyncio.open_connection(server_ip, ready["tcp_port"])
                    await _floor_round_trip(reader, writer, body, sizes)
                    if call:
                        times[size][way].append(time.perf_counter() - started)
    finally:
        await client.shutdown()
    print(json.dumps(times), flush=True)


TCP_TROUBLE = ("TcpRetransSegs", "TcpExtTCPTimeouts", "TcpExtTCPLossProbes")


def _tcp_counters(namespace: str) -> Counter:
    """This namespace's TCP counters of trouble (nstat, absolute): a shaped link that drops would show here."""
    out = subprocess.run(
        ["ip", "netns", "exec", namespace, "nstat", "-az", *TCP_TROUBLE], capture_output=True, text=True, check=True
    ).stdout
    return Counter({f[0]: int(f[1]) for f in (line.split() for line in out.splitlines()) if f and f[0] in TCP_TROUBLE})


def lab_floor(rates: list[float], sizes: list[int], calls: int, gap_s: float, root: Path) -> dict:
    """The transport floor across the lab (benchmarks/lab.py, root): the same framed echo as `transport_floor`,
    from one namespace to another over links shaped to each of `rates` Mbit/s both ways (each byte crosses the
    caller's upload and the server's download, as a pipeline call crosses the driver's link and a server's), through
    p2p daemons and through plain TCP. Against the payload at the link's rate (2 x size x 8 / rate): what the way
    adds a call (TCP: its headers, and whatever the shaped queue costs it; p2p beyond TCP: the daemons), and the TCP
    retransmissions and timeouts both namespaces counted meanwhile."""
    from lab import Lab, Link

    script = [sys.executable, str(Path(__file__).resolve())]
    common = ["--floor-calls", str(calls), "--floor-gap-s", str(gap_s), "--floor-bytes", *map(str, sizes)]
    result: dict = {"calls": calls, "gap_s": gap_s, "rates": {}}
    with Lab(2, host_link=False) as lab:
        addresses = root / "floor-server.json"
        lab.run(1, [*script, "--floor-peer", "serve", lab.ip(1), str(addresses), *common], root / "floor-server.out")
        _wait_lab_node(addresses.exists, lab, 1, "to start its echoes", root / "floor-server.out")
        for rate in rates:
            for index in range(2):
                lab.shape(index, Link(mbit=rate))
            before = [_tcp_counters(lab.ns(i)) for i in range(2)]
            log = root / f"floor-call-{rate:g}.out"
            caller = lab.run(0, [*script, "--floor-peer", "call", lab.ip(0), str(addresses), *common], log)
            if caller.wait(timeout=1800) != 0:
                raise RuntimeError(f"the lab floor's caller failed at {rate:g} Mbit/s: {log.read_text()[-3000:]}")
            trouble = sum(((_tcp_counters(lab.ns(i)) - before[i]) for i in range(2)), Counter())
            times = json.loads(log.read_text().strip().splitlines()[-1])
            rows = {}
            for size in sizes:
                payload_ms = 1000 * 2 * size * 8 / (rate * 1e6)
                row = {way: 1000 * statistics.median(t) for way, t in times[str(size)].items()}
                row.update(
                    payload_at_rate_ms=payload_ms,
                    tcp_beyond_payload_ms=row["tcp"] - payload_ms,
                    p2p_beyond_tcp_ms=row["p2p"] - row["tcp"],
                )
                rows[size] = row
                print(
                    f"lab floor {rate:g} Mbit/s {size:>9} B: payload at the rate {payload_ms:8.1f} ms, tcp "
                    f"{row['tcp']:8.1f} ms (+{row['tcp_beyond_payload_ms']:5.1f}), p2p {row['p2p']:8.1f} ms "
                    f"(+{row['p2p_beyond_tcp_ms']:5.1f} beyond tcp)",
                    flush=True,
                )
            print(f"lab floor {rate:g} Mbit/s: TCP trouble in both namespaces {dict(trouble) or 'none'}", flush=True)
            result["rates"][rate] = {"bytes": rows, "tcp_trouble": {k: trouble.get(k, 0) for k in TCP_TROUBLE}}
    return result


def check_cost(sizes: list[int], repeats: int) -> dict:
    """What a stage server's check of one received tensor costs (node/pipeline/tensors.py `expect`: the bytes become a
    tensor and every value must be finite), against the torch check it replaced (`from_wire`, then
    `torch.isfinite(t).all()`), on one torch thread as a server runs. Float32 and bfloat16 tensors of each size in
    bytes, the two ways interleaved call by call; medians in ms. Both ways must agree on a tensor with a NaN."""
    from node.pipeline.tensors import FLOATS, TensorRefused, expect, from_wire, to_wire

    def torch_check(wire) -> bool:
        return bool(torch.isfinite(from_wire(wire)).all())

    def shipped_check(wire) -> bool:
        try:
            expect({"x": wire}, "x", FLOATS, tuple(wire.shape))
        except TensorRefused:
            return False
        return True

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rows: dict = {}
    try:
        for size in sizes:
            for dtype in (torch.float32, torch.bfloat16):
                values = torch.randn(size // (torch.finfo(dtype).bits // 8), dtype=dtype)
                wire = to_wire(values)
                spoiled = values.clone()
                spoiled[len(spoiled) // 2] = float("nan")
                if torch_check(to_wire(spoiled)) or shipped_check(to_wire(spoiled)) or not shipped_check(wire):
                    raise RuntimeError(f"the two checks disagree on a {dtype} tensor of {size} bytes")
                times: dict[str, list[float]] = {"torch": [], "shipped": []}
                for repeat in range(repeats + 1):  # the first of each way warms it up and is not counted
                    for way, check in (("torch", torch_check), ("shipped", shipped_check)):
                        started = time.perf_counter()
                        check(wire)
                        if repeat:
                            times[way].append(time.perf_counter() - started)
                row = {way: 1000 * statistics.median(t) for way, t in times.items()}
                row["torch_over_shipped"] = row["torch"] / row["shipped"]
                rows[f"{size} {str(dtype).removeprefix('torch.')}"] = row
                print(
                    f"{size:>9} B {str(dtype).removeprefix('torch.'):>8}: torch.isfinite {row['torch']:7.3f} ms, "
                    f"shipped (numpy) {row['shipped']:7.3f} ms, {row['torch_over_shipped']:5.1f}x",
                    flush=True,
                )
    finally:
        torch.set_num_threads(threads)
    return {"repeats": repeats, "threads": 1, "ms": rows}


PROTOBUF_PROBE = r"""
import json, os, sys, time
sys.path.insert(0, sys.argv[1])
from node.transport.protobuf_shim import import_hivemind_isolated
import_hivemind_isolated()
from google.protobuf.internal import api_implementation
from hivemind.proto import dht_pb2, p2pd_pb2
repeats = int(sys.argv[2])
found = dht_pb2.FindResponse()  # a DHT node's answer to a get: 8 keys' values and their nearest peers
for _ in range(8):
    result = found.results.add(type=dht_pb2.FOUND_REGULAR, value=os.urandom(600), expiration_time=1e9)
    result.nearest_node_ids.extend(os.urandom(20) for _ in range(5))
    result.nearest_peer_ids.extend(os.urandom(38) for _ in range(5))
opening = p2pd_pb2.Request(type=p2pd_pb2.Request.STREAM_OPEN)  # what each pipeline call asks its p2p daemon
opening.streamOpen.peer = os.urandom(38)
opening.streamOpen.proto.append("swarm-node/v1/swarm/pipeline/0123456789abcdef/v1")
us = {}
for name, message in (("dht_find_response", found), ("stream_open_request", opening)):
    data = message.SerializeToString()
    started = time.perf_counter()
    for _ in range(repeats):
        parsed = type(message)()
        parsed.ParseFromString(data)
        if parsed.SerializeToString() != data:
            raise SystemExit(f"{name} did not round-trip")
    us[name] = {"bytes": len(data), "us": 1e6 * (time.perf_counter() - started) / repeats}
print(json.dumps({"implementation": api_implementation.Type(), "messages": us}))
"""


def protobuf_cost(repeats: int) -> dict:
    """What parsing and re-serializing a protobuf message costs in each implementation of google.protobuf (its C
    runtime, upb, the default; and pure Python), each in a fresh interpreter: a hivemind DHT answer and a p2p daemon
    stream-open request, the messages a stage server's event loop handles. upb calls malloc_trim(0) every 10,000 of
    its arena frees, which hands back the memory torch just freed (node/host_memory.py); pure Python does not, and
    costs this much more a message."""
    rows = {}
    for implementation in ("upb", "python"):
        env = {**os.environ, "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION": implementation}
        out = subprocess.run(
            [sys.executable, "-c", PROTOBUF_PROBE, str(REPO), str(repeats)],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            timeout=600,
        )
        row = json.loads(out.stdout.strip().splitlines()[-1])
        if row["implementation"] != implementation:
            raise RuntimeError(f"asked for protobuf's {implementation} implementation, got {row['implementation']}")
        rows[implementation] = row["messages"]
    for name, upb in rows["upb"].items():
        python = rows["python"][name]
        print(
            f"{name} ({upb['bytes']} B): upb {upb['us']:.1f} us, pure Python {python['us']:.1f} us a message, "
            f"{python['us'] / upb['us']:.0f}x",
            flush=True,
        )
    return {
        "repeats": repeats,
        "us_per_message": rows,
        "python_over_upb": {name: rows["python"][name]["us"] / upb["us"] for name, upb in rows["upb"].items()},
    }


def parse_variant(text: str) -> tuple[str, list[str]]:
    name, _, settings = text.partition(":")
    return name, [setting for setting in settings.split(",") if setting]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), help=f"of {list(SIZES)}")
    parser.add_argument("--stages", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--steps", type=int, default=2, help="timed steps per way per round")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds over the ways")
    parser.add_argument("--tiny", action="store_true", help="a 4-layer, 32-wide model, 1 round of 1 step: a test")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override for all")
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME:KEY=VALUE[,KEY=VALUE]",
        help="another wire way with these settings, side by side (e.g. bf16:pipeline.wire_dtype=bfloat16)",
    )
    parser.add_argument("--variant-stages", nargs="+", type=int, default=[4], help="the S the variants run at")
    parser.add_argument("--one-process-threads", nargs="+", type=int, default=[1], help="torch threads, a way each")
    parser.add_argument(
        "--loss-check", type=int, default=0, metavar="STEPS", help="train local S=max(--stages) and each variant "
        "this many steps in process and compare their losses (no servers; instead of the timing)",
    )  # fmt: skip
    parser.add_argument(
        "--loss-check-one-process", nargs="*", default=["tied"], choices=list(ONE_PROCESS_WAYS), metavar="WAY",
        help=f"--loss-check: the whole model in one process too, each way of {list(ONE_PROCESS_WAYS)} (untied: the "
        "head its own copy of the embedding; stage-clip: each stage's gradient norm clipped apart, as the pipeline's)",
    )  # fmt: skip
    parser.add_argument(
        "--lab", nargs="+", type=float, metavar="MBIT", help="instead: the lab at these link rates (root), "
        "at S = max(--stages); a variant's `driver:KEY=VALUE` settings apply to the driver only",
    )  # fmt: skip
    parser.add_argument(
        "--lab-uploads", type=float, default=0.0, metavar="MB", help="--lab: every way again while each server's host "
        "uploads a file of MB to a store over its own link, again and again (checkpoints in the background)",
    )  # fmt: skip
    parser.add_argument(
        "--recovery", action="store_true", help="instead: stall per recovery method (loopback), as shipped and with "
        "each --variant's settings",
    )  # fmt: skip
    parser.add_argument("--recovery-repeats", type=int, default=1, help="--recovery: runs of each way, interleaved")
    parser.add_argument(
        "--transport-floor", action="store_true", help="instead: a framed echo of each --floor-bytes through two "
        "p2p daemons and through plain TCP on 127.0.0.1, no compute: what the wire alone costs a call; with --lab, "
        "between two lab namespaces on links shaped to each rate (root)",
    )  # fmt: skip
    parser.add_argument(
        "--check-cost", action="store_true", help="instead: what checking one received tensor of each --floor-bytes "
        "costs a stage server, the shipped check against torch.isfinite, no network",
    )  # fmt: skip
    parser.add_argument(
        "--protobuf-cost", action="store_true", help="instead: what parsing and re-serializing a DHT answer and a "
        "stream-open request costs in protobuf's upb and pure-Python implementations (--floor-calls times each)",
    )  # fmt: skip
    parser.add_argument("--floor-bytes", nargs="+", type=int, default=FLOOR_BYTES)
    parser.add_argument("--floor-calls", type=int, default=30, help="timed echoes per size and way")
    parser.add_argument(
        "--floor-gap-s", type=float, default=0.1, help="--transport-floor --lab: quiet before each echo, as a call "
        "follows a stage's compute",
    )  # fmt: skip
    # one end of the lab's floor, started by `lab_floor` inside a namespace: ROLE IP ADDRESSES_FILE
    parser.add_argument("--floor-peer", nargs=3, metavar=("ROLE", "IP", "ADDRESSES"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    # SIGTERM as Ctrl-C: the servers run in process groups of their own, which only our `finally` blocks end
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    sizes = TINY if args.tiny else {name: SIZES[name] for name in args.sizes}
    settings = list(args.set)
    variants = dict(parse_variant(v) for v in args.variant)
    if args.tiny:
        settings += ["pipeline.micro_batch_size=2", "pipeline.micro_batches=2", "pipeline.sequence_length=16"]
        args.steps, args.rounds = 1, 1
    # this process's torch work (one process, the local ways, the driver) under the allocator its servers run with
    kept = load_config(REPO / "configs" / "pipeline.yaml", settings).pipeline.keep_freed_memory and keep_freed_memory()
    started = time.time()
    summary: dict = {
        "benchmark": "pipeline_throughput",
        "date": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime(started)),
        "freed_memory_kept": kept,  # node/host_memory.py, in this process and (the same setting) its servers
    }
    if args.floor_peer:
        role, ip, addresses = args.floor_peer
        gap_s = args.floor_gap_s
        asyncio.run(floor_peer(role, ip, Path(addresses), args.floor_bytes, args.floor_calls, gap_s))
        return
    if args.lab and args.transport_floor:
        sys.path.insert(0, str(REPO / "benchmarks"))
        with tempfile.TemporaryDirectory(prefix="pipeline-throughput-lab-floor-") as scratch:
            floor = lab_floor(args.lab, args.floor_bytes, args.floor_calls, args.floor_gap_s, Path(scratch))
        summary.update(load_average=os.getloadavg(), lab_transport_floor=floor)
        print(json.dumps(summary))
        return
    if args.lab:
        sys.path.insert(0, str(REPO / "benchmarks"))
        with tempfile.TemporaryDirectory(prefix="pipeline-throughput-lab-") as scratch:
            runs = {
                name: lab_run(
                    name,
                    shape,
                    max(args.stages),
                    settings,
                    variants,
                    args.lab,
                    args.steps,
                    Path(scratch),
                    args.lab_uploads,
                )
                for name, shape in sizes.items()
            }
        summary.update(load_average=os.getloadavg(), settings=settings, stages=max(args.stages), lab=runs)
        print(json.dumps(summary))
        return
    if args.transport_floor:
        floor = asyncio.run(transport_floor(args.floor_bytes, args.floor_calls))
        summary.update(load_average=os.getloadavg(), transport_floor=floor)
        print(json.dumps(summary))
        return
    if args.protobuf_cost:
        summary.update(load_average=os.getloadavg(), protobuf_cost=protobuf_cost(args.floor_calls))
        print(json.dumps(summary))
        return
    if args.check_cost:
        summary.update(load_average=os.getloadavg(), check_cost=check_cost(args.floor_bytes, args.floor_calls))
        print(json.dumps(summary))
        return
    if args.recovery:
        ways = {"plain": settings} | {name: settings + extra for name, extra in variants.items()}
        events: dict[str, list[dict]] = {name: [] for name in sizes}
        with tempfile.TemporaryDirectory(prefix="pipeline-throughput-recovery-") as scratch:
            for repeat in range(args.recovery_repeats):  # the ways interleaved, so that they share the machine's load
                for name, shape in sizes.items():
                    for way, way_settings in ways.items():
                        run = asyncio.run(
                            recovery_run(f"{name}-{way}-{repeat}", shape, way_settings, args.steps, Path(scratch))
                        )
                        events[name] += [dict(event, way=way, repeat=repeat) for event in run]
        summary.update(
            load_average=os.getloadavg(),
            settings=settings,
            variants=variants,
            recovery_s_by_method=events,
            stall_s_by_way_and_method=print_stalls(events),
        )
        print(json.dumps(summary))
        return
    if args.loss_check:
        torch.set_num_threads(1)
        checks = [
            loss_check(
                name, shape, max(args.stages), settings, variants, args.loss_check, tuple(args.loss_check_one_process)
            )
            for name, shape in sizes.items()
        ]
        for check in checks:
            print(check)
        summary.update(load_average=os.getloadavg(), settings=settings, loss_check=checks)
        print(json.dumps(summary))
        return
    results = {}
    with tempfile.TemporaryDirectory(prefix="pipeline-throughput-") as scratch:
        for name, shape in sizes.items():
            results[name] = asyncio.run(
                measure_size(
                    name,
                    shape,
                    args.stages,
                    settings,
                    variants,
                    [s for s in args.variant_stages if s in args.stages] if variants else [],
                    args.one_process_threads,
                    args.steps,
                    args.rounds,
                    Path(scratch),
                )
            )
            print_size(name, results[name])
    summary.update(load_average=os.getloadavg(), settings=settings, steps=args.steps, rounds=args.rounds, sizes=results)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
