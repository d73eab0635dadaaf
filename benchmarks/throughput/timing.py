"""The default mode: each size through S serve processes on loopback against the same model in one process and
split in process, side by side (step time, tokens/s, a call's round trip less its compute, bytes each way)."""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

from benchmarks.common import REPO
from benchmarks.throughput.calls import compute_per_call, hop_overhead_ms, server_ms_per_call, summarize_calls
from benchmarks.throughput.harness import (
    Calls,
    LocalRouter,
    OneProcess,
    Servers,
    TimedRouter,
    copy_model,
    fresh_dir,
    lm_driver,
    local_handlers,
    overrides,
    runner_step,
    swarm_slug,
    tokens_per_step,
)
from node.config import load_config
from node.device import HOST
from node.model import model_fingerprint, resolve_initial_policy
from node.pipeline.corpus import training_corpus
from node.pipeline.handler import CALL_PHASES
from node.pipeline.stages import (
    expected_fingerprints,
    pipeline_limits,
)
from node.transport.session import join_swarm
from protocol import NodeIdentity


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
            shape, s, f"bench-throughput-{name}-s{s}-{swarm_slug(v)}-{os.getpid()}", settings + variants.get(v, [])
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
        "one_process" + (f" {t} threads" if t != base.torch_threads else ""): OneProcess(
            base, copy_model(model), corpus, t
        )
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
            ways[f"local {s}"] = lm_driver(config, router, corpus, root / f"{name}-local-{s}")
        for s, v in keys[1:]:
            way = f"wire {s}" + (f" {v}" if v else "")
            servers[way] = Servers(fresh_dir(root / f"{name}-{way.replace(' ', '-')}"), lists[(s, v)], s)
        for (s, v), (way, group) in zip(keys[1:], servers.items()):
            group.wait_serving()
            peers = "swarm.initial_peers=" + json.dumps(group.addresses(0))
            config = load_config(REPO / "configs" / "pipeline.yaml", [*lists[(s, v)], peers])
            state_dir = fresh_dir(root / f"{name}-driver-{way.replace(' ', '-')}")
            session = await join_swarm(config, NodeIdentity.load_or_create(state_dir / "identity.key"), state_dir)
            sessions.append(session)
            calls[way] = Calls()
            fingerprints = expected_fingerprints(config, model.config, fingerprint)
            limits = pipeline_limits(config, model.config, parameters)
            router = TimedRouter(session.dht, config, fingerprint, fingerprints, limits, calls=calls[way])
            await router.wait_until_served()
            ways[way] = lm_driver(config, router, corpus, state_dir / "run")
        steps_s: dict[str, list[float]] = defaultdict(list)
        losses: dict[str, list[float]] = defaultdict(list)
        for way, runner in ways.items():  # warm-up: first calls open streams, allocate, fill caches
            await runner_step(runner)
        for record in calls.values():
            record.rows.clear()
        for router in local_routers.values():
            router.work.clear()
        warmed = time.time()
        served_before = {way: group.served(after=warmed) for way, group in servers.items()}
        for _ in range(rounds):
            for way, runner in ways.items():
                for _ in range(steps):
                    row = await runner_step(runner)
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
