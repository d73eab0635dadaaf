"""An arm's run: the 4 nodes in this process, trained in lockstep through the in-process exchange, their held-out
accuracy along their compute; what a round of an arm costs (--round-cost); the warm-start gate (--gate)."""

from __future__ import annotations

import asyncio
import copy
import hashlib
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from node.averaging.inprocess import InProcessAverager, InProcessBoard
from node.averaging.service import OuterStepService
from node.compute import RoundWork, UnitCosts, model_shape_key, round_layout
from node.config import load_config
from node.loop import Node
from node.tasks import materialize
from node.trainer import completion_logprobs
from node.transport.inprocess import InProcessExchange, InProcessTransport
from protocol import TaskSpec

from benchmarks.arms.catalog import (
    CONFIG,
    FOUR_CONFIG,
    HELDOUT_PER_SPECIALTY,
    NODES,
    PRETRAINED_CONFIG,
    base_arm,
    node_overrides,
    own_specialty,
    weak_specialty,
)


def heldout_questions(config, per_specialty: int = HELDOUT_PER_SPECIALTY) -> list:
    """`per_specialty` fixed questions per specialty, from the held-out seed (no training stream draws from it)."""
    return [
        materialize(TaskSpec(d.name, d.config, config.tasks.heldout_seed, i))
        for d in config.tasks.datasets
        for i in range(per_specialty)
    ]


def in_process_averaging(node: Node, boards: dict[str, InProcessBoard]) -> OuterStepService:
    """The node's NoLoCo/DiLoCo service over an in-process board (one per method), weights through the real codec."""
    averaging = node.config.averaging
    board = boards.setdefault(averaging.method, InProcessBoard(group_size=2 if averaging.method == "noloco" else None))
    averager = InProcessAverager(
        board, node.identity.node_id, averaging.transfer_dtype, averaging.max_relative_distance
    )
    service = OuterStepService(node.config, node.model, averager)
    service.last_trigger_version = node.policy_version
    return service


async def make_nodes(setting: str, arm: str, seed: int, scratch: str, args) -> list[Node]:
    exchange = InProcessExchange()
    boards: dict[str, InProcessBoard] = {}
    nodes: list[Node] = []
    for i in range(NODES):
        overrides = node_overrides(setting, arm, seed, i, args)
        if args.transport == "inprocess":
            # averaging windows pair peers over the DHT; in lockstep the exchange count pairs them (one per trigger)
            overrides.append("averaging.window_s=0.001")
        if args.transport == "dht":  # real p2p daemons and DHT nodes on loopback, gossip included
            overrides += ['swarm.host_maddrs=["/ip4/127.0.0.1/tcp/0"]', "swarm.window_s=30"]
            overrides += [f"swarm.initial_peers={json.dumps(nodes[0].addresses)}"] if nodes else []
        config = args.config
        if args.config == CONFIG:
            config = {"four": FOUR_CONFIG, "pretrained": PRETRAINED_CONFIG}.get(setting, CONFIG)
        node = Node(load_config(str(config), overrides, state_dir=f"{scratch}/{setting}-{arm}-{seed}/{i}"))
        node.load(fresh=True, progress=False)
        if args.transport == "inprocess":
            node.transport = InProcessTransport(exchange, node.config, node.identity, node.stats, node.fingerprint)
            if node.config.averaging.method != "none":
                node.averaging = in_process_averaging(node, boards)
        await node.start_services()
        nodes.append(node)
    return nodes


def evaluate(node: Node, questions: list) -> dict[str, float]:
    overall, by_label = node.evaluator.report(questions)
    return {"all": overall, **{label: score.accuracy for label, score in by_label.items()}}


KL_PROMPTS = 64  # held-out questions of the node's own specialty, each answered KL_SAMPLES times
KL_SAMPLES = 4


def weights_digest(model: torch.nn.Module) -> str:
    """The first 12 hex digits of the sha256 of the model's weights, bit for bit. The default model is built on each
    machine, and two machines built different warm starts from the same recipe
    (benchmarks/notebook/2026-11-28-sharing-compute-units.md, "The default model rebuilt
    on this machine"): rows that started from different weights must not be compared as one seed."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:12]


def kl_to_warm_start(node: Node, warm, questions: list) -> float:
    """KL(pi_t || pi_warm) on the node's own specialty (RL's Razor's predictor of forgetting): sequences sampled from
    pi_t on held-out prompts, mean over them of sum_t log pi_t - log pi_warm (the sampler's log-probs are pi_t's at
    its temperature; pi_warm's are recomputed at the same temperature)."""
    prompts = [node.tasks.prompt(q) for q in questions[:KL_PROMPTS]]
    samples = [c for group in node.backend.generate(prompts, KL_SAMPLES, seed=7) for c in group if c.completion_ids]
    with torch.no_grad():
        warm_logprobs, mask = completion_logprobs(
            warm,
            [(c.prompt_ids, c.completion_ids) for c in samples],
            node.tokenizer.pad_token_id,
            node.config.rollout.temperature,
        )
    current = sum(sum(c.logprobs) for c in samples)
    return (current - float((warm_logprobs * mask).sum())) / len(samples)


async def run_arm(setting: str, arm: str, seed: int, args, scratch: str) -> dict:
    nodes = await make_nodes(setting, arm, seed, scratch, args)
    try:
        return await train_in_lockstep(nodes, setting, arm, seed, args)
    finally:
        for node in nodes:
            await node.stop_services()
            node.backend.close()


def unit_costs(node: Node, path: Path) -> UnitCosts:
    config = node.model.config
    layout = round_layout(node.config.rollout.share_prompt_prefill, node.trainer.share_prompts)
    shape = model_shape_key(
        config.hidden_size, config.num_hidden_layers, config.intermediate_size, config.vocab_size, layout
    )
    return UnitCosts.load(path, shape)


async def train_in_lockstep(nodes: list[Node], setting: str, arm: str, seed: int, args) -> dict:
    questions = heldout_questions(nodes[0].config, args.heldout_per_specialty)
    costs = unit_costs(nodes[0], args.costs)
    cpu = [0.0] * NODES
    units = [0.0] * NODES
    # the budget's axis: compute units (the load cannot move them) or, as before 2026-11-26, CPU seconds
    compute = units if args.axis == "units" else cpu
    phases = [{"generation_s": 0.0, "scoring_s": 0.0, "sharing_s": 0.0, "update_s": 0.0} for _ in nodes]
    work = [RoundWork() for _ in nodes]
    rounds = [0] * NODES

    own_questions = [
        [q for q in questions if node.tasks.label(q.spec) == own_specialty(setting, i)] for i, node in enumerate(nodes)
    ]
    # each node's warm start, frozen: how far training has moved it on what it knew (a copy only where a node has a
    # specialty of its own to measure that on: four copies of a 135M-parameter model are 2 GB)
    warm = [copy.deepcopy(node.model).eval() if own_questions[i] else None for i, node in enumerate(nodes)]
    digests = [weights_digest(node.model) for node in nodes]
    start_scores: dict[str, dict[str, float]] = {}

    def point(i: int, node: Node) -> dict:
        kl = {"kl_own_vs_warm": kl_to_warm_start(node, warm[i], own_questions[i])} if own_questions[i] else {}
        if rounds[i] == 0:  # nodes that start from the same weights answer the same greedy held-out: measured once
            scores = start_scores.setdefault(digests[i], evaluate(node, questions))
        else:
            scores = evaluate(node, questions)
        measured = {
            **kl,
            "compute_s": compute[i],
            "cpu_s": cpu[i],
            "units": units[i],
            "round": rounds[i],
            **scores,
        }
        # every point as it is measured: a run stopped before its end (a lent machine's time limit) keeps its curve
        print(f"  point {setting} {arm} seed {seed} node {i}: {json.dumps(measured)}", flush=True)
        return measured

    curves: list[list[dict]] = [[point(i, node)] for i, node in enumerate(nodes)]
    rewards: list[list[float]] = [[] for _ in nodes]
    groups_used: list[list[int]] = [[] for _ in nodes]
    importance: list[float] = []
    rescored: list[int] = []
    taken: list[int] = []
    imitated: list[int] = []
    step = args.budget / args.points
    started = time.monotonic()
    while True:
        active = [
            i for i in range(NODES) if (compute[i] < args.budget if args.rounds is None else rounds[i] < args.rounds)
        ]
        if not active:
            break
        for i in active:
            node = nodes[i]
            before = time.process_time()
            row = await node.run_round()
            cpu[i] += time.process_time() - before
            round_work = RoundWork.from_dict(row["work"])
            units[i] += costs.units(round_work)
            work[i] = work[i] + round_work
            for phase in phases[i]:
                phases[i][phase] += row.get(phase, 0.0)
            rounds[i] += 1
            rewards[i].append(row["reward_mean"])
            groups_used[i].append(row["groups_used"])
            if "importance_weight_mean" in row:
                importance.append(row["importance_weight_mean"])
            if "external_rescored" in row:
                rescored.append(row["external_rescored"])
                taken.append(row["external_questions"])
            imitated.append(row.get("imitation_sequences", 0))
            next_point = step * len(curves[i]) if args.rounds is None else None
            if next_point is not None and compute[i] >= next_point - 1e-9:
                curves[i].append(point(i, node))
        if sum(rounds) % (NODES * 50) == 0:  # progress, in budget and in --rounds runs alike
            print(
                f"  {setting} {arm} seed {seed}: rounds {rounds}, {args.axis} {[round(c) for c in compute]}, "
                f"{time.monotonic() - started:.0f} s wall",
                flush=True,
            )
    if args.rounds is not None:
        for i, node in enumerate(nodes):
            curves[i].append(point(i, node))
    return {
        "axis": args.axis,
        "cpu_s": cpu,
        "units": units,
        "work": [w.as_dict() for w in work],
        "phases_s": phases,
        "setting": setting,
        "arm": arm,
        "seed": seed,
        "transport": args.transport,
        "budget_s": args.budget,
        "rounds_limit": args.rounds,
        "warmup_steps": args.warmup_steps if setting != "sparse" else {"both": args.sparse_warmup_steps},
        "warm_start_digests": digests,
        "heldout_per_specialty": args.heldout_per_specialty,
        "overrides": args.set,
        "weak": [weak_specialty(setting, i) for i in range(NODES)],
        "own": [own_specialty(setting, i) for i in range(NODES)],
        "rounds": rounds,
        "compute_s": compute,
        "curves": curves,
        "reward_per_round": [statistics.fmean(r) for r in rewards],
        "cumulative_reward": [sum(r) for r in rewards],
        "groups_used_per_update": statistics.fmean(g for per_node in groups_used for g in per_node),
        "importance_weight_mean": statistics.fmean(importance) if importance else None,
        "rescored_per_round": statistics.fmean(rescored) if rescored else None,
        "external_taken_per_round": statistics.fmean(taken) if taken else None,
        "imitation_sequences_per_round": statistics.fmean(imitated),
        # exchanges and bytes of the arms that average (their CPU, a few encodes and sums every 50 updates, is not
        # in the units)
        "averaging": [node.averaging.counters() if node.averaging else None for node in nodes],
        "wall_s": time.monotonic() - started,
        "finished": time.time(),
    }


async def round_cost(args) -> dict:
    """What a round of each arm costs, its arms' nodes interleaved round by round so that they share the machine's load:
    CPU seconds and compute units per round, each phase's share, and how well units predict the CPU seconds."""
    phases = ("generation_s", "scoring_s", "sharing_s", "update_s")
    with tempfile.TemporaryDirectory() as scratch:
        arms = {arm: await make_nodes(args.setting, arm, args.seeds[0], scratch, args) for arm in args.arms}
        # each arm's units by its own layout's calibration (node/compute.py LAYOUTS)
        costs = {arm: unit_costs(nodes[0], args.costs) for arm, nodes in arms.items()}
        rows: dict[str, list[dict]] = {arm: [] for arm in arms}
        try:
            for warm in (True, False):  # a few rounds first: the first ones build caches and are not typical
                for _ in range(args.round_cost_warmup if warm else args.round_cost):
                    for arm, nodes in arms.items():
                        for node in nodes:
                            before = time.process_time()
                            row = await node.run_round()
                            cpu = time.process_time() - before
                            if not warm:
                                split = costs[arm].split(RoundWork.from_dict(row["work"]))
                                rows[arm].append({"cpu_s": cpu, "units": sum(split.values()), "split": split, **row})
        finally:
            for nodes in arms.values():
                for node in nodes:
                    await node.stop_services()
                    node.backend.close()
    table = {}
    for arm, arm_rows in rows.items():
        table[arm] = {
            "rounds": len(arm_rows),
            "cpu_s_per_round": statistics.fmean(r["cpu_s"] for r in arm_rows),
            "units_per_round": statistics.fmean(r["units"] for r in arm_rows),
            "wall_s_by_phase": {phase: statistics.fmean(r.get(phase, 0.0) for r in arm_rows) for phase in phases},
            "units_by_kind": {
                kind: statistics.fmean(r["split"][kind] for r in arm_rows) for kind in arm_rows[0]["split"]
            },
            "work_per_round": {key: statistics.fmean(r["work"][key] for r in arm_rows) for key in arm_rows[0]["work"]},
        }
        table[arm]["units_per_cpu_s"] = table[arm]["units_per_round"] / table[arm]["cpu_s_per_round"]
    every = [r for arm_rows in rows.values() for r in arm_rows]
    mean_cpu = statistics.fmean(r["cpu_s"] for r in every)
    # how well units predict a round's CPU time: R^2 of cpu = k * units (k fitted), over every round of every arm
    k = sum(r["cpu_s"] * r["units"] for r in every) / sum(r["units"] ** 2 for r in every)
    residual = sum((r["cpu_s"] - k * r["units"]) ** 2 for r in every)
    total = sum((r["cpu_s"] - mean_cpu) ** 2 for r in every)
    summary = {
        "benchmark": "sharing_round_cost",
        "setting": args.setting,
        "seed": args.seeds[0],
        "overrides": args.set,  # --set, on every arm alike
        "arms": table,
        "cpu_s_per_unit_fitted": k,
        "units_predict_cpu_r2": 1 - residual / total,
        "load_average_1min": os.getloadavg()[0],
    }
    # against --baseline (the best single-node recipe) where it ran, else the plain silo
    silo = base_arm(args.baseline) if base_arm(args.baseline) in table else "silo"
    if silo in table:
        summary["round_cost_baseline"] = silo
        summary["round_cost_ratio_vs_silo"] = {
            arm: {
                "units": row["units_per_round"] / table[silo]["units_per_round"],
                "cpu_s": row["cpu_s_per_round"] / table[silo]["cpu_s_per_round"],
            }
            for arm, row in table.items()
        }
    for arm, row in table.items():
        ratio = summary.get("round_cost_ratio_vs_silo", {}).get(arm)
        print(
            f"{arm:20s} {row['cpu_s_per_round']:.3f} CPU s, {row['units_per_round']:.3f} units a round"
            + (f" ({ratio['cpu_s']:.2f}x / {ratio['units']:.2f}x a silo round)" if ratio else "")
            + "; wall s by phase "
            + ", ".join(f"{phase.removesuffix('_s')} {v:.3f}" for phase, v in row["wall_s_by_phase"].items())
            + "; units by kind "
            + ", ".join(f"{kind} {v:.3f}" for kind, v in row["units_by_kind"].items()),
            flush=True,
        )
    return summary


def gate(args) -> None:
    """Each specialist's held-out on both specialties after its warm start, and its sampled success on the weak one."""
    with tempfile.TemporaryDirectory() as scratch:
        nodes = asyncio.run(make_nodes("specialists", "silo", 0, scratch, args))
        questions = heldout_questions(nodes[0].config)
        for i in (0, 2):
            node = nodes[i]
            held = evaluate(node, questions)
            weak = weak_specialty("specialists", i)
            weak_questions = [q for q in node.tasks.batch(0, 200) if node.tasks.label(q.spec) == weak][:64]
            completions = node.backend.generate([node.tasks.prompt(q) for q in weak_questions], 8, seed=1)
            scored = [node.local.score_group(q, c, "local")[1] for q, c in zip(weak_questions, completions)]
            sampled = sum(scored) / (8 * len(scored))
            print(
                json.dumps(
                    {
                        "gate": True,
                        "warmup_steps": args.warmup_steps,
                        "node": i,
                        "heldout": held,
                        "weak": weak,
                        "sampled_success_weak": sampled,
                    }
                ),
                flush=True,
            )


# report ----------------------------------------------------------------------------------------
