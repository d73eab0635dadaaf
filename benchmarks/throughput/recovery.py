"""--recovery: the stall each recovery method costs the driver, on loopback."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import time
from pathlib import Path

import torch

from benchmarks.common import REPO, read_json_lines
from benchmarks.throughput.harness import Servers, fresh_dir, lm_driver, overrides
from node.config import load_config
from node.device import HOST
from node.model import model_fingerprint, resolve_initial_policy
from node.pipeline.corpus import training_corpus
from node.pipeline.driver import PipelineRouter
from node.pipeline.stagemap import LostReporter
from node.pipeline.stages import (
    expected_fingerprints,
    pipeline_limits,
)
from node.transport.session import join_swarm
from protocol import NodeIdentity


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
    group = Servers(fresh_dir(root / f"recovery-{name}"), sets, 4)
    extra: list[Servers] = []
    session = None
    events = []
    try:
        group.wait_serving()
        peers = group.addresses(0)
        extra.append(Servers(fresh_dir(root / f"recovery-{name}-replica"), sets, 0, more=[("2", peers)]))
        extra[-1].wait_serving()
        config = load_config(REPO / "configs" / "pipeline.yaml", [*sets, "swarm.initial_peers=" + json.dumps(peers)])
        state_dir = fresh_dir(root / f"recovery-{name}-driver")
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
        driver = lm_driver(config, router, corpus, state_dir / "run")
        normal = [(await driver.train_step())["step_s"] for _ in range(steps + 1)][1:]
        step_s = statistics.median(normal)
        for stage, method in ((None, "replica failover"), (1, "checkfree"), (3, "checkfree_plus")):
            spare = None
            if method != "replica failover":
                spare = Servers(fresh_dir(root / f"recovery-{name}-spare-{stage}"), sets, 0, more=[("spare", peers)])
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
            loaded = read_json_lines(spare.root / "server-0" / "recoveries.jsonl") if spare else []
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
