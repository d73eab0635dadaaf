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
micro-batch, each way (driver -> servers, servers -> driver: every hop goes through the
driver, see node/pipeline/driver.py). Prints its figures and ends with one JSON line.

    .venv/bin/python benchmarks/pipeline_throughput.py                 # the three sizes, S = 2 and 4
    .venv/bin/python benchmarks/pipeline_throughput.py --tiny   # about a minute: tests/test_pipeline_throughput.py
    .venv/bin/python benchmarks/pipeline_throughput.py --sizes 27M --set pipeline.wire_dtype=bfloat16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from node.transport.protobuf_shim import import_hivemind_isolated  # noqa: E402

import_hivemind_isolated()

import torch  # noqa: E402

from node.config import NodeConfig, load_config  # noqa: E402
from node.device import HOST  # noqa: E402
from node.model import model_fingerprint, resolve_initial_policy  # noqa: E402
from node.pipeline.backend import StageBackend  # noqa: E402
from node.pipeline.corpus import micro_batch, training_corpus  # noqa: E402
from node.pipeline.driver import PipelineRouter  # noqa: E402
from node.pipeline.handler import StageHandler  # noqa: E402
from node.pipeline.lm import LMDriver, full_masks, lm_loss  # noqa: E402
from node.pipeline.stages import (  # noqa: E402
    PipelineStage,
    expected_fingerprints,
    extra_parts_for,
    pipeline_limits,
    stage_plan,
)
from node.state import StateStore  # noqa: E402
from node.transport.session import join_swarm  # noqa: E402
from protocol import NodeIdentity  # noqa: E402

# name -> (hidden, decoder layers, heads, MLP width); parameters counted at run time (the char vocabulary is 100)
SIZES = {
    "0.34M": (64, 8, 2, 128),  # stage_recovery's pipeline model
    "5M": (256, 8, 4, 512),
    "27M": (512, 8, 8, 1536),  # about 1 s per 512-token micro-batch on one thread of this machine
}
TINY = {"tiny": (32, 4, 2, 64)}
START_S = 300  # a server imports torch and hivemind and starts p2pd: generous on a loaded 2-core machine


def overrides(shape: tuple[int, int, int, int], stages: int, swarm_id: str, settings: list[str]) -> list[str]:
    hidden, layers, heads, intermediate = shape
    return [
        f"model.default.hidden_size={hidden}",
        f"model.default.num_layers={layers}",
        f"model.default.num_heads={heads}",
        f"model.default.intermediate_size={intermediate}",
        "model.default.warmup_steps=0",
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


class Calls:
    """Every call of a way: op, hop, seconds, tensor payload bytes out (to the server) and in (back)."""

    def __init__(self) -> None:
        self.rows: list[dict] = []

    def record(self, call, result, seconds: float) -> None:
        hop = call.call_id.rsplit("-", 1)[-1] if call.op in ("forward", "backward") else "-"
        self.rows.append(
            {
                "op": call.op,
                "stage": call.stage,
                "hop": hop,
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

    async def pick_route(self, hops):
        return {stage: self.servers[stage] for stage, _ in hops}

    async def call(self, server, call, timeout=None):
        started = time.perf_counter()
        result = await self.handlers[server.stage].serve("driver", call)
        self.calls.record(call, result, time.perf_counter() - started)
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
    """The whole model trained in this process on the driver's micro-batches: the baseline."""

    def __init__(self, config: NodeConfig, model, corpus: torch.Tensor) -> None:
        self.config, self.model, self.corpus = config, model, corpus
        p = config.pipeline
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=p.lr, weight_decay=p.weight_decay)
        self.step = 0

    def train_step(self) -> dict:
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
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), p.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"loss": sum(losses) / len(losses), "step_s": time.perf_counter() - started}


class Servers:
    """S `swarm-node serve` processes of one pipeline, each in its own process group (ended by its own id)."""

    def __init__(self, root: Path, config_overrides: list[str], stages: int) -> None:
        self.root = root
        self.procs: list[subprocess.Popen] = []
        self.logs = []
        args = ["--config", str(REPO / "configs" / "pipeline.yaml")]
        for setting in config_overrides:
            args += ["--set", setting]
        for index in range(stages):
            state_dir = root / f"server-{index}"
            command = [sys.executable, "-m", "node.cli", "serve", *args, "--state-dir", str(state_dir)]
            command += ["--stage", str(index)]
            if index:
                command += ["--initial-peers", *self.addresses(0)]
            log = open(root / f"server-{index}.out", "w")
            self.logs.append(log)
            self.procs.append(
                subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
            )
            self.addresses(index)

    def addresses(self, index: int) -> list[str]:
        path = self.root / f"server-{index}" / "addresses.txt"
        self._wait(lambda: path.exists() and path.read_text().split(), index, "to join")
        return path.read_text().split()

    def wait_serving(self) -> None:
        for index in range(len(self.procs)):
            self._wait(lambda: (self.root / f"server-{index}" / "recoveries.jsonl").exists(), index, "to serve")

    def _wait(self, ready, index: int, what: str) -> None:
        deadline = time.monotonic() + START_S
        while not ready():
            if self.procs[index].poll() is not None:
                raise RuntimeError(f"server {index} exited: {(self.root / f'server-{index}.out').read_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"server {index} did not manage {what} in {START_S}s")
            time.sleep(0.2)

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


def summarize_calls(rows: list[dict], micro_batches: int) -> dict:
    """Mean seconds by op, and tensor payload bytes per micro-batch, each way (forward and backward calls)."""
    by_op: dict[str, list[float]] = defaultdict(list)
    for row in rows:
        by_op[row["op"]].append(row["s"])
    passes = max(1, micro_batches)
    moved = {
        f"{op}_{way}": sum(r[way] for r in rows if r["op"] == op) / passes
        for op in ("forward", "backward")
        for way in ("out", "in")
    }
    hops = sum(1 for r in rows if r["op"] == "forward") / passes
    return {
        "calls_s": {op: statistics.fmean(v) for op, v in by_op.items()},
        "calls": {op: len(v) for op, v in by_op.items()},
        "hops_per_micro_batch": hops,
        "bytes_per_micro_batch": moved,
    }


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
    name: str, shape, stage_counts: list[int], settings: list[str], steps: int, rounds: int, root: Path
) -> dict:
    """Every way for one model size, `rounds` interleaved rounds of `steps` steps each (after one warm-up step)."""
    lists = {
        s: overrides(shape, s, f"bench-throughput-{name}-s{s}-{os.getpid()}", settings) for s in [1, *stage_counts]
    }
    configs = {s: load_config(REPO / "configs" / "pipeline.yaml", lists[s]) for s in lists}
    base = configs[1]
    torch.set_num_threads(base.torch_threads)
    torch.manual_seed(base.seed)
    model, tokenizer = resolve_initial_policy(base, None, HOST)
    parameters = sum(p.numel() for p in model.parameters())
    fingerprint = model_fingerprint(model, tokenizer)
    corpus = training_corpus(base, tokenizer)
    ways: dict[str, object] = {"one_process": OneProcess(base, _copy(model), corpus)}
    calls: dict[str, Calls] = {}
    servers, sessions = [], []
    try:
        for s in stage_counts:
            config = configs[s]
            fingerprints = expected_fingerprints(config, model.config, fingerprint)
            calls[f"local {s}"] = Calls()
            router = LocalRouter(config, local_handlers(config, model, fingerprints), fingerprints, calls[f"local {s}"])
            ways[f"local {s}"] = _driver(config, router, corpus, root / f"{name}-local-{s}")
            servers.append(Servers(_fresh(root / f"{name}-servers-{s}"), lists[s], s))
        for s, group in zip(stage_counts, servers):
            group.wait_serving()
            peers = "swarm.initial_peers=" + json.dumps(group.addresses(0))
            config = load_config(REPO / "configs" / "pipeline.yaml", [*lists[s], peers])
            state_dir = _fresh(root / f"{name}-driver-{s}")
            session = await join_swarm(config, NodeIdentity.load_or_create(state_dir / "identity.key"), state_dir)
            sessions.append(session)
            calls[f"wire {s}"] = Calls()
            fingerprints = expected_fingerprints(config, model.config, fingerprint)
            limits = pipeline_limits(config, model.config, parameters)
            router = TimedRouter(session.dht, config, fingerprint, fingerprints, limits, calls=calls[f"wire {s}"])
            await router.wait_until_served()
            ways[f"wire {s}"] = _driver(config, router, corpus, state_dir / "run")
        steps_s: dict[str, list[float]] = defaultdict(list)
        losses: dict[str, list[float]] = defaultdict(list)
        for way, runner in ways.items():  # warm-up: first calls open streams, allocate, fill caches
            await _step(runner)
        for record in calls.values():
            record.rows.clear()
        for _ in range(rounds):
            for way, runner in ways.items():
                for _ in range(steps):
                    row = await _step(runner)
                    steps_s[way].append(row["step_s"])
                    losses[way].append(row["loss"])
    finally:
        for session in sessions:
            await session.close()
        for group in servers:
            group.close()
    tokens = tokens_per_step(base)
    result = {
        "parameters": parameters,
        "tokens_per_step": tokens,
        "micro_batch": [base.pipeline.micro_batch_size, base.pipeline.sequence_length, model.config.hidden_size],
        "vocab_size": model.config.vocab_size,
        "ways": {},
    }
    one = statistics.median(steps_s["one_process"])
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
        if way.startswith("wire"):
            entry["overhead_ms"] = hop_overhead_ms(calls[way].rows, calls["local" + way[4:]].rows)
        result["ways"][way] = entry
    return result


def _copy(model):
    import copy

    return copy.deepcopy(model)


def _fresh(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def _driver(config: NodeConfig, router, corpus, state_dir: Path) -> LMDriver:
    return LMDriver(config, router, corpus, corpus[:1], StateStore(_fresh(state_dir)))


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
        f"{'way':<12} {'step s':>8} {'tokens/s':>9} {'x one':>6} {'hops/mb':>7} {'fwd ms':>7} {'bwd ms':>7} "
        f"{'ovh fwd':>8} {'ovh bwd':>8} {'ovh step':>8} {'MB/mb out':>9} {'MB/mb in':>9}"
    )
    for way, e in result["ways"].items():
        calls = e.get("calls_s", {})
        ovh = e.get("overhead_ms", {})
        moved = e.get("bytes_per_micro_batch", {})
        out = (moved.get("forward_out", 0) + moved.get("backward_out", 0)) / 1e6
        back = (moved.get("forward_in", 0) + moved.get("backward_in", 0)) / 1e6
        print(
            f"{way:<12} {e['step_s']:>8.3f} {e['tokens_per_s']:>9.0f} {e['vs_one_process']:>6.2f} "
            f"{e.get('hops_per_micro_batch', 0):>7.1f} {1000 * calls.get('forward', 0):>7.1f} "
            f"{1000 * calls.get('backward', 0):>7.1f} {ovh.get('forward', math.nan):>8.1f} "
            f"{ovh.get('backward', math.nan):>8.1f} {ovh.get('step', math.nan):>8.1f} {out:>9.3f} {back:>9.3f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), help=f"of {list(SIZES)}")
    parser.add_argument("--stages", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--steps", type=int, default=2, help="timed steps per way per round")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds over the ways")
    parser.add_argument("--tiny", action="store_true", help="a 4-layer, 32-wide model, 1 round of 1 step: a test")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override for all")
    args = parser.parse_args()
    sizes = TINY if args.tiny else {name: SIZES[name] for name in args.sizes}
    settings = list(args.set)
    if args.tiny:
        settings += ["pipeline.micro_batch_size=2", "pipeline.micro_batches=2", "pipeline.sequence_length=16"]
        args.steps, args.rounds = 1, 1
    started = time.time()
    results = {}
    with tempfile.TemporaryDirectory(prefix="pipeline-throughput-") as scratch:
        for name, shape in sizes.items():
            results[name] = asyncio.run(
                measure_size(name, shape, args.stages, settings, args.steps, args.rounds, Path(scratch))
            )
            print_size(name, results[name])
    summary = {
        "benchmark": "pipeline_throughput",
        "date": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime(started)),
        "load_average": os.getloadavg(),
        "settings": settings,
        "steps": args.steps,
        "rounds": args.rounds,
        "sizes": results,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
