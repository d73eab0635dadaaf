"""Sharing that pays: does a swarm teach a node what it lacks, for the compute the node spends?

Workload (configs/specialists.yaml): the default one-task arithmetic (1-digit, 2 terms) split
into two specialties by operator, `add` and `subtract`. Settings:
  specialists  nodes 0-1 warm-started on `add` only, nodes 2-3 on `subtract` only; every node
               then trains on both. A node's *weak* specialty is the one it was not warm-started on.
  homogeneous  every node warm-started on both (the same warm start): sharing must not hurt.
  sparse       every node barely warm-started (rewards a few percent), binary reward: SAPO's
               regime, to compare its 4/4 against the paper's silo (zero-advantage groups kept)
               and against ours (dropped).
  pretrained   a real pretrained model (configs/smollm2_swarm.yaml: SmolLM2-135M-Instruct on its
               two-task mix), no warm start: four equal nodes from the same weights, measured on
               --heldout-per-specialty questions of each task (50: the 100 of tasks.heldout_size).
Arms (same seeds and warm starts; --arms picks, ARMS below lists them): `silo` generates and trains
on 8 own questions a round; `sapo` generates 4 and trains on 4 own + 4 peers' (SAPO's 4/4, peers'
groups drawn uniformly among those with a reward spread); `sapo_imitate` draws peers' groups by weakness and
adds the imitation term (trainer.imitation_coef 4) over stronger peers' right answers and the node's
own (swarm.imitation); `silo_imitate` is its fair silo, the same term over its own right answers only
(configs/isolated.yaml); `sapo_balance_gated` is the shipped sharing (configs/specialists.yaml); `silo12` generates
12 and keeps 8, those with a spread first (the "just more sampling" control); `paper_silo` / `paper_sapo`
keep zero-advantage groups in the batch as the paper's baseline did. Arms of mechanisms that lost and left the
product are gone (RETIRED_ARMS); their stored runs are still read by --report.

The real path, only the network hop replaced: the 4 nodes live in this process and run in
lockstep, one round each in turn; what a node publishes is the signed record a DHT store would
carry and peers read it through the same receiver (node/transport/inprocess.py), then draw,
re-generate and re-score it as from the network (node/sharing.py).

Axis: each node's own compute, CPU seconds of this process while that node's round runs
(generation, scoring, re-scoring of peers' groups, update; torch on 1 thread; the held-out
evaluation is not counted). A node stops at --budget seconds; held-out accuracy (greedy, 200
fixed questions per specialty from a seed training never draws) is measured at --points equal
steps of its compute. The network is charged apart: --network-charge x a silo round's mean
compute per swarm round (0.081: the lab's measured overhead of a swarm round over an isolated
one, publish + collect + re-score, benchmarks/notebook/2026-11-23-lab.md).

Every (setting, arm, seed) run appends one JSON line to --results as it finishes, so seeds
accumulate over several invocations (also several processes at once); `--report` reads the file,
prints the figures and the plot (--plot), and ends with one JSON line.

    .venv/bin/python benchmarks/sharing.py --gate                                  # warm-start gate
    .venv/bin/python benchmarks/sharing.py --setting specialists --arms silo_imitate sapo_balance_gated --seeds 0 1 2
    .venv/bin/python benchmarks/sharing.py --report --plot benchmarks/sharing.png
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import hashlib
import json
import math
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Collection
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from node.config import load_config  # noqa: E402
from node.loop import Node  # noqa: E402
from node.compute import RoundWork, UnitCosts, model_shape_key, round_layout  # noqa: E402
from node.files import append_json_line  # noqa: E402
from node.tasks import materialize  # noqa: E402
from node.trainer import completion_logprobs  # noqa: E402
from node.transport.inprocess import InProcessExchange, InProcessTransport  # noqa: E402
from node.averaging.inprocess import InProcessAverager, InProcessBoard  # noqa: E402
from node.averaging.service import OuterStepService  # noqa: E402
from protocol import TaskSpec  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "specialists.yaml"
FOUR_CONFIG = REPO / "configs" / "four_specialists.yaml"
PRETRAINED_CONFIG = REPO / "configs" / "smollm2_swarm.yaml"
NODES = 4
SPECIALTIES = ("add", "subtract")
# --setting four: node i warm-started on FOUR_SPECIALTIES[i] alone, every node measured on all four
FOUR_SPECIALTIES = ("add", "subtract", "multiply", "lcm")
HELDOUT_PER_SPECIALTY = 200
# issue #33: a node's own specialty ends no more than this under the same node alone, or its gain elsewhere is a trade
OWN_SKILL_TOLERANCE_POINTS = 2.0

# Every sharing knob an arm does not set, pinned: an arm means the same whatever the config file ships
# (configs/specialists.yaml turns imitation on for users).
ARM_BASE = [
    "swarm.external_selection=uniform",
    "swarm.imitation=none",
    "trainer.imitation_coef=0.0",
    "swarm.local_draw=mix",
    "swarm.external_gate=none",
    "swarm.own_replay=0",
    "trainer.kl_beta=0.0",
    "averaging.method=none",
]
SWARM_4_4 = ["swarm.local_questions=4", "swarm.external_questions=4", "swarm.generated_questions=4"]
SWARM_IMITATE = [*SWARM_4_4, "swarm.external_selection=weakness", "swarm.imitation=own_and_stronger_peers"]
# the isolated default: 8 own questions a round, its own right answers as demonstrations
SILO_IMITATE = [
    "swarm.local_questions=8",
    "swarm.external_questions=0",
    "swarm.generated_questions=8",
    "swarm.imitation=own",
    "trainer.imitation_coef=4.0",
]
# the shipped sharing: SAPO 4/4, peers' groups drawn by weakness, stronger peers' right answers as demonstrations, own
# questions drawn after peers' groups so that the round's batch keeps each specialty's share of the mix
SAPO_BALANCE = [*SWARM_IMITATE, "trainer.imitation_coef=4.0", "swarm.local_draw=balance"]
ARMS = {
    "silo": ["swarm.local_questions=8", "swarm.external_questions=0", "swarm.generated_questions=8"],
    "sapo": SWARM_4_4,
    "sapo_imitate": [*SWARM_IMITATE, "trainer.imitation_coef=4.0"],
    "silo_imitate": SILO_IMITATE,
    "sapo_balance": SAPO_BALANCE,
    # every completion its own row, its prompt repeated in it, in the sampler's prefill and the update's forward
    # (before rollout.share_prompt_prefill and trainer.share_prompt_forward)
    "silo_imitate_rows": [
        *SILO_IMITATE,
        "trainer.share_prompt_forward=false",
        "rollout.share_prompt_prefill=false",
    ],
    "sapo_balance_rows": [
        *SAPO_BALANCE,
        "trainer.share_prompt_forward=false",
        "rollout.share_prompt_prefill=false",
    ],
    # the shipped arm sharing less: 6 own questions and 2 of peers' groups a round (SAPO's 6/2)
    "sapo_balance_6_2": [
        *SAPO_BALANCE,
        "swarm.local_questions=6",
        "swarm.external_questions=2",
        "swarm.generated_questions=6",
    ],
    # the shipped sharing generating 8 own questions and training on the 4 with a reward spread first (SAPO's
    # equal-compute comparison): near the ceiling most of a node's own groups are all right
    "sapo_balance_gen8": [*SAPO_BALANCE, "swarm.generated_questions=8"],
    # the shipped arm taking a peer's group only where that peer is measurably stronger in its specialty, its own
    # questions in place of the rest (issue #33 section 3's success-gated transfer): equal nodes train as silos do
    "sapo_balance_gated": [*SAPO_BALANCE, "swarm.external_gate=stronger_peer"],
    # NoLoCo as configs/swarm.yaml offers it (a random partner every 50 updates, outer lr 0.7, momentum 0.5, fp16 on
    # the wire), beside the shipped sharing and beside the silo alone (issue #33 section 3: does the averaging the
    # README offers help specialists or harm them?)
    "sapo_balance_noloco": [*SAPO_BALANCE, "averaging.method=noloco"],
    "silo_imitate_noloco": [*SILO_IMITATE, "averaging.method=noloco"],
    # between equal nodes: SAPO's exchange with the silo's own-answer imitation and no peer's answer as a demonstration,
    # peers' groups drawn by SAPO's rule (uniform) or, as shipped, where this node is weaker (with the balanced draw)
    "sapo_own": [*SWARM_4_4, "swarm.imitation=own", "trainer.imitation_coef=4.0"],
    "sapo_balance_own": [*SAPO_BALANCE, "swarm.imitation=own"],
    "silo12": ["swarm.local_questions=8", "swarm.external_questions=0", "swarm.generated_questions=12"],
    "paper_silo": [
        "swarm.local_questions=8",
        "swarm.external_questions=0",
        "swarm.generated_questions=8",
        "trainer.drop_uniform_groups=false",
    ],
    "paper_sapo": [*SWARM_4_4, "trainer.drop_uniform_groups=false"],
}
SWARM_ARMS = {  # the arms that take peers' groups: the last external_questions an arm sets is the one in effect
    name
    for name, overrides in ARMS.items()
    if [o for o in overrides if o.startswith("swarm.external_questions=")][-1:]
    not in ([], ["swarm.external_questions=0"])
}
# Arms of mechanisms that lost and left the product (benchmarks/README.md, "Mechanisms that did not ship", names the
# commit where each one's code can still be read): no longer runnable, but --report still reads their stored runs, and
# whether one took peers' groups, for which these are its labels.
RETIRED_ARMS = {
    # HACPO's capability corrections (swarm.capability_aware), with its sequence-level importance weight
    # (trainer.importance_level), without importance weights, or generating 8
    "sapo_cap": "swarm",
    "sapo_cap_seq": "swarm",
    "sapo_cap_unweighted": "swarm",
    "gen8_cap": "swarm",
    # peers' groups as demonstrations only (swarm.external_use demonstrations_only)
    "silo_imitate_peers": "swarm",
    # CHORD's token weight and decaying coefficient (trainer.imitation_token_weight, imitation_coef_final)
    "sapo_balance_chord": "swarm",
    # on-policy distillation from a stronger peer's policy (trainer.distill_coef, node/teachers.py)
    "silo_distill": "alone",
    # trainer.specialty_weighting equal, projected (PCGrad), separate_steps
    "sapo_balance_equal": "swarm",
    "sapo_balance_projected": "swarm",
    "sapo_balance_separate": "swarm",
    "silo_imitate_equal": "alone",
    "silo_imitate_projected": "alone",
    "silo_imitate_separate": "alone",
    # only a peer's answers above its group's mean in the policy term (trainer.off_policy_negatives false, LUFFY)
    "sapo_balance_positive": "swarm",
    # a KL anchor on the node's own specialty (trainer.kl_labels)
    "sapo_balance_anchor": "swarm",
    # peers' groups ramped in over 200 rounds (swarm.sharing_ramp_rounds)
    "sapo_balance_ramp": "swarm",
}
REPORTED_SWARM_ARMS = SWARM_ARMS | {arm for arm, kind in RETIRED_ARMS.items() if kind == "swarm"}


def warm_start_overrides(setting: str, node: int, steps: dict[str, int], sparse_steps: int) -> list[str]:
    if setting == "pretrained":
        return []  # the model's own pretraining is the start
    if setting in ("specialists", "four"):
        own = own_specialty(setting, node)
        # a specialty without steps of its own (--warmup-steps multiply=N) takes the homogeneous nodes' count
        own_steps = steps.get(own, steps["both"])
        return [f"model.default.warmup_steps={own_steps}", f'model.default.warmup_labels=["{own}"]']
    if setting == "homogeneous":
        return [f"model.default.warmup_steps={steps['both']}"]
    return [f"model.default.warmup_steps={sparse_steps}"]


def parse_warmup_steps(items: list[str]) -> dict[str, int]:
    """'260' (every warm start) or 'add=100 subtract=230 both=260' (per specialist, and the homogeneous nodes')."""
    steps: dict[str, int] = {}
    for item in items:
        label, sep, value = item.rpartition("=")
        for key in [label] if sep else [*SPECIALTIES, "both"]:
            steps[key] = int(value)
    missing = {*SPECIALTIES, "both"} - set(steps)
    if missing:
        raise argparse.ArgumentTypeError(f"--warmup-steps: no steps for {sorted(missing)}")
    return steps


def own_specialty(setting: str, node: int) -> str | None:
    """The specialty node `node` was warm-started on (None: all of them)."""
    if setting == "four":
        return FOUR_SPECIALTIES[node * len(FOUR_SPECIALTIES) // NODES]
    return SPECIALTIES[node * len(SPECIALTIES) // NODES] if setting == "specialists" else None


def weak_specialty(setting: str, node: int) -> str | None:
    """The specialty node `node` was not warm-started on (None: it was warm-started on both, or it lacks three of
    four)."""
    if setting != "specialists":
        return None
    own = SPECIALTIES[node * len(SPECIALTIES) // NODES]
    return next(label for label in SPECIALTIES if label != own)


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


def node_overrides(setting: str, arm: str, seed: int, node: int, args) -> list[str]:
    """Node `node`'s config overrides in an arm, on top of the setting's config file: ARM_BASE first, so that what the
    file ships for users (the gate, replay, imitation) never leaks into an arm that does not name it."""
    overrides = [
        *ARM_BASE,
        *ARMS[arm],
        *warm_start_overrides(setting, node, args.warmup_steps, args.sparse_warmup_steps),
        *args.set,
        "swarm.transport=dht",
        "swarm.swarm_id=sharing-bench",
        "checkpoint_every=1000000",
        "eval_every=0",
        "torch_threads=1",
        f"seed={100 * seed + node}",
        f"name=node-{node}",
    ]
    if setting == "sparse":
        overrides.append("tasks.format_reward=0.0")  # binary reward: right or not
    return overrides


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


def warm_start_mismatches(by_key: dict) -> list[str]:
    """Each (setting, seed) whose arms' runs started from different warm starts (runs without a digest, stored
    before it was recorded, are not checked)."""
    digests: dict[tuple[str, int], dict[str, tuple]] = {}
    for (setting, label), seeds in by_key.items():
        for seed, run in seeds.items():
            if run.get("warm_start_digests"):
                digests.setdefault((setting, seed), {})[label] = tuple(run["warm_start_digests"])
    return [
        f"{setting} seed {seed}: " + "; ".join(f"{label} {','.join(d)}" for label, d in sorted(by_label.items()))
        for (setting, seed), by_label in sorted(digests.items())
        if len(set(by_label.values())) > 1
    ]


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


def interpolate(curve: list[dict], key: str, axis: str, x: float) -> float:
    """The curve's `key` where its `axis` ("compute_s" or "round") is `x`, linearly interpolated between its evaluation
    points."""
    for before, after in zip(curve, curve[1:]):
        if after[axis] >= x:
            span = after[axis] - before[axis]
            t = 0.0 if span <= 0 else (x - before[axis]) / span
            return before[key] + t * (after[key] - before[key])
    return curve[-1][key]


def at_compute(curve: list[dict], key: str, compute_s: float) -> float:
    return interpolate(curve, key, "compute_s", compute_s)


def first_reach(run: dict, which: str, target: float) -> float | None:
    """The node compute at which the run's mean curve first reaches `target` (None: never within its budget)."""
    xs, ys = mean_curve(run, which, points=200)
    return next((x for x, y in zip(xs, ys) if y >= target - 1e-12 and x > 0), None)


def node_metric(run: dict, node: int, compute_s: float, which: str) -> float:
    """'weak': the node's weak specialty; 'own': the one it was warm-started on; 'all': every specialty."""
    weak = run["weak"][node]
    own = (run.get("own") or [None] * NODES)[node]  # rows from before "own" was stored: the specialty not weak
    key = (
        weak
        if which == "weak" and weak
        else own
        if which == "own" and own
        else next(label for label in SPECIALTIES if label != weak)
        if which == "own" and weak
        else "all"
    )
    return at_compute(run["curves"][node], key, compute_s)


def mean_metric(run: dict, compute_s: float, which: str) -> float:
    return statistics.fmean(node_metric(run, i, compute_s, which) for i in range(NODES))


LATE_POINTS = 5  # own_gain_per_node reads each curve at this many equal steps over the budget's last third


def late_own(run: dict, node: int, compute_s: float) -> float:
    """The node's held-out on its own specialty averaged over the last third of `compute_s`."""
    xs = [compute_s * (2 / 3 + k / (3 * (LATE_POINTS - 1))) for k in range(LATE_POINTS)]
    return statistics.fmean(node_metric(run, node, x, "own") for x in xs)


def own_gain_per_node(runs: dict, silo: dict, seeds: list[int], compute_s: float) -> dict[int, list[float]]:
    """Seed -> each node's own specialty against the same node alone (the silo run of that seed: the same warm start),
    in points to a tenth, averaged over the last third of `compute_s`: a mean over nodes can hide a node that lost, and
    one node's held-out on a specialty swings by 10-20 points between evaluations 50 units apart."""
    return {
        s: [round(100 * (late_own(runs[s], n, compute_s) - late_own(silo[s], n, compute_s)), 1) for n in range(NODES)]
        for s in seeds
    }


def silo_twin_differences(silo: dict, seeds: list[int], compute_s: float) -> dict[int, list[float]]:
    """Seed -> for each pair of the silo's nodes warm-started alike (the same weak specialty), the first's own
    specialty less the second's, as `own_gain_per_node` measures it. The twins differ only in their sampling: what
    separates them is what separates any node from "the same node alone" when nothing else differs, the resolution
    of the per-node figure."""
    out = {}
    for s in seeds:
        run = silo[s]
        pairs = [(a, b) for a in range(NODES) for b in range(a + 1, NODES) if run["weak"][a] == run["weak"][b]]
        out[s] = [round(100 * (late_own(run, a, compute_s) - late_own(run, b, compute_s)), 1) for a, b in pairs]
    return out


def mean_curve(run: dict, which: str, points: int = 20) -> tuple[list[float], list[float]]:
    xs = [run["budget_s"] * k / points for k in range(points + 1)]
    return xs, [mean_metric(run, x, which) for x in xs]


def spread(values: list[float]) -> dict:
    return {
        "mean": statistics.fmean(values),
        "stdev": statistics.stdev(values) if len(values) > 1 else 0.0,
        "min": min(values),
        "max": max(values),
        "per_seed": values,
    }


def arm_label(run: dict) -> str:
    """The arm, and the --set overrides it ran with, if any: `sapo_imitate[kl_beta=0.04]`."""
    overrides = run.get("overrides") or []
    short = [key.split(".")[-1] + "=" + value for key, _, value in (o.partition("=") for o in overrides)]
    return run["arm"] + (f"[{','.join(short)}]" if short else "")


def base_arm(label: str) -> str:
    return label.split("[")[0]


def arm_or_variant(value: str) -> str:
    """--report-arms / --baseline: an arm (`sapo_balance_gated`, or a retired one whose runs are stored) or one variant
    of it by its full label (`sapo_balance_gated[own_replay=4]`, the label the report prints for a run with --set
    swarm.own_replay=4)."""
    if base_arm(value) not in ARMS and base_arm(value) not in RETIRED_ARMS:
        known = f"arms: {', '.join(ARMS)}; retired: {', '.join(RETIRED_ARMS)}"
        raise argparse.ArgumentTypeError(f"{value!r}: no such arm ({known})")
    if value != base_arm(value) and not re.fullmatch(r"[^\[\]]+\[[^\[\]]+=[^\[\]]*\]", value):
        raise argparse.ArgumentTypeError(f"{value!r}: a variant is ARM[key=value,...], as the report labels it")
    return value


def single_node_arm(value: str) -> str:
    value = arm_or_variant(value)
    if base_arm(value) in REPORTED_SWARM_ARMS:
        raise argparse.ArgumentTypeError(f"{value!r} takes peers' groups: the baseline is a node alone")
    return value


def may_be_best(label: str, named: Collection[str]) -> bool:
    """Whether the summary may name `label` its best swarm arm: a plain swarm arm, or a variant (an arm run with --set
    overrides) that --report-arms named by its full label; a pilot variant stored beside them never is."""
    return base_arm(label) in REPORTED_SWARM_ARMS and (label == base_arm(label) or label in named)


def on_axis(run: dict) -> dict:
    """The run as the report reads it: `compute_s` and `budget_s` on the run's own axis (units runs: compute units)."""
    if run.get("axis", "cpu") != "units":
        return run
    view = dict(run)
    view["compute_s"] = run["units"]
    view["curves"] = [[{**p, "compute_s": p["units"]} for p in curve] for curve in run["curves"]]
    return view


def cut_at(run: dict, budget: float) -> dict:
    """A run with a longer budget read as if it had stopped at `budget` (its curves hold points there: --points with
    the budget a multiple of the step): its held-out points up to it, each node's rounds and compute at its last one.
    Its per-round means (sampled reward, groups used, peers' groups re-scored) stay the whole run's."""
    if run["rounds_limit"] is not None or run["budget_s"] <= budget:
        return run
    view = dict(run, budget_s=budget, cut_from_budget=run["budget_s"])
    view["curves"] = [[p for p in curve if p["compute_s"] <= budget * 1.01] for curve in run["curves"]]
    view["rounds"] = [curve[-1]["round"] for curve in view["curves"]]
    view["compute_s"] = [curve[-1]["compute_s"] for curve in view["curves"]]
    return view


def json_lines(paths: list[Path]) -> list[dict]:
    """Every JSON line of the files, in order."""
    return [json.loads(line) for path in paths for line in path.read_text().splitlines() if line.strip()]


def report(args) -> None:
    runs = json_lines([args.results, *args.more_results])
    runs.sort(key=lambda run: run.get("finished", 0))  # across files too, the newest run of a key counts
    # one axis at a time: a budget in units and one in CPU seconds are not the same work
    runs = [on_axis(run) for run in runs if run.get("axis", "cpu") == args.axis]
    # one transport at a time (--transport): a run through the DHT must not stand in for its seed's in-process one
    runs = [run for run in runs if run.get("transport", "inprocess") == args.transport]
    # arms are compared at one budget: longer runs are read up to it, shorter ones left out
    if args.report_budget is not None:
        runs = [cut_at(run, args.report_budget) for run in runs]
        runs = [run for run in runs if run["rounds_limit"] is not None or run["budget_s"] == args.report_budget]
        for run in runs:
            if "cut_from_budget" in run:
                label = f"{arm_label(run)} seed {run['seed']}"
                print(f"{label}: a run of {run['cut_from_budget']:g} read up to {args.report_budget:g}")
    # arms whose runs shared the machine's load: CPU seconds per round move with it
    # (benchmarks/notebook/2026-11-26-sharing-cpu-seconds.md)
    named = args.report_arms or []
    if named:
        runs = [run for run in runs if run["arm"] in named or arm_label(run) in named]
    # the newest run of each (setting, arm and its --set overrides, seed) counts; the sparse setting's runs are
    # compared at one horizon (--rounds) at a time: a longer run is another figure, not a newer one
    by_key: dict[tuple[str, str], dict[int, dict]] = {}
    sparse_by_rounds: dict[int, dict[str, dict[int, dict]]] = {}
    for run in runs:
        if run["setting"] == "sparse":
            sparse_by_rounds.setdefault(run["rounds_limit"], {}).setdefault(arm_label(run), {})[run["seed"]] = run
        else:
            by_key.setdefault((run["setting"], arm_label(run)), {})[run["seed"]] = run
    summary: dict = {"benchmark": "sharing", "compute_axis": args.axis, "baseline": args.baseline}
    if mismatches := warm_start_mismatches(by_key):
        print("WARNING: these arms started from different warm starts (built on different machines?), so their")
        print("differences are not the arms' alone:\n  " + "\n  ".join(mismatches))
        summary["warm_start_mismatches"] = mismatches
    if args.baseline != "silo":  # the best single-node recipe plays the silo every arm is measured against
        for setting in {setting for setting, _ in by_key}:
            if (setting, args.baseline) in by_key:
                plain = by_key.pop((setting, "silo"), None)
                if plain:
                    by_key[(setting, "silo_plain")] = plain
                by_key[(setting, "silo")] = by_key.pop((setting, args.baseline))
        print(f"the silo below is {args.baseline!r} (plain SAPO-less silo: 'silo_plain')")
    summary.update(four_specialists(by_key, named))
    four_arms = {arm: seeds for (setting, arm), seeds in by_key.items() if setting == "four"}
    if args.plot_four and four_arms:
        plot_four(four_arms, args.plot_four, args.axis, args.baseline)
    costs = json_lines([path for path in args.round_cost_results if path.exists()])
    if ratios := round_cost_against(costs, args.baseline):
        summary["round_cost_ratio_vs_silo"] = ratios
    else:
        print(f"no --round-cost line in {[str(p) for p in args.round_cost_results]} measured against {args.baseline!r}")
    silo_round_s = (
        statistics.fmean(
            c / r
            for run in by_key.get(("specialists", "silo"), {}).values()
            for c, r in zip(run["compute_s"], run["rounds"])
        )
        if ("specialists", "silo") in by_key
        else None
    )

    # specialists: held-out on the weak specialty at equal compute, and the speed-up
    spec_arms = {
        arm: seeds
        for (setting, arm), seeds in by_key.items()
        if setting == "specialists" and seeds[next(iter(seeds))]["rounds_limit"] is None
    }
    if "silo" in spec_arms:
        silo = spec_arms["silo"]
        print(
            f"specialists: weak-specialty held-out (mean of {NODES} nodes) at equal node compute; silo round "
            f"{silo_round_s:.3f} s of compute"
        )
        table = {}
        for arm, seeds in sorted(spec_arms.items()):
            common = sorted(set(seeds) & set(silo))
            if not common:
                continue
            row = {"seeds": common}
            budget = min(seeds[s]["budget_s"] for s in common)
            row["weak_start"] = spread([mean_metric(seeds[s], 0.0, "weak") for s in common])
            row["weak_final"] = spread([mean_metric(seeds[s], budget, "weak") for s in common])
            row["own_final"] = spread([mean_metric(seeds[s], budget, "own") for s in common])
            row["both_final"] = spread([mean_metric(seeds[s], budget, "all") for s in common])
            if all("kl_own_vs_warm" in seeds[s]["curves"][0][-1] for s in common):
                # RL's Razor: how far the node moved from its warm start on what it knew (nats per sequence)
                row["kl_own_vs_warm_final"] = spread(
                    [statistics.fmean(curve[-1]["kl_own_vs_warm"] for curve in seeds[s]["curves"]) for s in common]
                )
            row["both_gain_points_vs_silo"] = spread(
                [100 * (mean_metric(seeds[s], budget, "all") - mean_metric(silo[s], budget, "all")) for s in common]
            )
            row["weak_gain_points_vs_silo"] = spread(
                [100 * (mean_metric(seeds[s], budget, "weak") - mean_metric(silo[s], budget, "weak")) for s in common]
            )
            row["own_gain_points_vs_silo"] = spread(
                [100 * (mean_metric(seeds[s], budget, "own") - mean_metric(silo[s], budget, "own")) for s in common]
            )
            row["own_gain_points_per_node_and_seed"] = own_gain_per_node(seeds, silo, common, budget)
            row["budget_s"] = budget
            swarm_arm = base_arm(arm) in REPORTED_SWARM_ARMS
            if swarm_arm and "silo_imitate" in spec_arms and set(common) <= set(spec_arms["silo_imitate"]):
                # the fair silo of an arm that imitates: the same imitation term on its own right answers only
                control = spec_arms["silo_imitate"]
                row["weak_gain_points_vs_silo_imitate"] = spread(
                    [
                        100 * (mean_metric(seeds[s], budget, "weak") - mean_metric(control[s], budget, "weak"))
                        for s in common
                    ]
                )
            charge = args.network_charge * silo_round_s if swarm_arm else 0.0
            speedups, speedups_net = [], []
            for s in common:
                # S = the compute the silo needs to reach its final held-out / what this arm needs to reach it
                # (the silo's own curve is noisy: it may touch its final level before the end of its budget)
                target = mean_metric(silo[s], budget, "weak")
                silo_reach = first_reach(silo[s], "weak", target) or budget
                reach = first_reach(seeds[s], "weak", target)
                rounds_per_s = statistics.fmean(r / c for r, c in zip(seeds[s]["rounds"], seeds[s]["compute_s"]))
                speedups.append(silo_reach / reach if reach else 0.0)
                speedups_net.append(silo_reach / (reach * (1 + charge * rounds_per_s)) if reach else 0.0)
            row["speedup"] = spread(speedups)
            row["speedup_with_network"] = spread(speedups_net)
            row["sampled_reward_ratio_vs_silo"] = spread(
                [
                    statistics.fmean(seeds[s]["reward_per_round"]) / statistics.fmean(silo[s]["reward_per_round"])
                    for s in common
                ]
            )
            row["groups_used_per_update"] = statistics.fmean(seeds[s]["groups_used_per_update"] for s in common)
            weights = [
                seeds[s]["importance_weight_mean"] for s in common if seeds[s]["importance_weight_mean"] is not None
            ]
            row["importance_weight_mean"] = statistics.fmean(weights) if weights else None
            rescored = [seeds[s]["rescored_per_round"] for s in common if seeds[s]["rescored_per_round"] is not None]
            row["rescored_per_round"] = statistics.fmean(rescored) if rescored else None
            row["rounds_per_node"] = statistics.fmean(r for s in common for r in seeds[s]["rounds"])
            table[arm] = row
            print(
                f"  {arm:13s} seeds {common}: weak {row['weak_start']['mean']:.3f} -> {row['weak_final']['mean']:.3f} "
                f"({row['weak_gain_points_vs_silo']['mean']:+.1f} points vs silo, per seed "
                f"{[round(v, 1) for v in row['weak_gain_points_vs_silo']['per_seed']]}), "
                f"own {row['own_final']['mean']:.3f}, both {row['both_final']['mean']:.3f} "
                f"({row['both_gain_points_vs_silo']['mean']:+.1f} points vs silo), S {row['speedup']['mean']:.2f}x "
                f"({row['speedup_with_network']['mean']:.2f}x with network), "
                f"reward ratio {row['sampled_reward_ratio_vs_silo']['mean']:.3f}, groups/update "
                f"{row['groups_used_per_update']:.2f}, "
                f"rounds {row['rounds_per_node']:.0f}, own vs the same node alone over the last third, points per seed "
                f"{row['own_gain_points_per_node_and_seed']}"
                + (
                    f", importance weight {row['importance_weight_mean']:.3f}"
                    if row["importance_weight_mean"] is not None
                    else ""
                )
                + (
                    f", {row['weak_gain_points_vs_silo_imitate']['mean']:+.1f} points vs silo_imitate"
                    if "weak_gain_points_vs_silo_imitate" in row
                    else ""
                ),
                flush=True,
            )
        summary["specialists"] = table
        # an arm run with --set overrides is a variant (its label says which), never the shipped arm
        swarm_rows = {arm: row for arm, row in table.items() if may_be_best(arm, named)}
        # the best arm among those run on the most seeds: a 2-seed pilot must not outrank a 3-seed result
        swarm_rows = on_most_seeds(swarm_rows, lambda row: row["seeds"])
        if swarm_rows:
            # the swarm must add: the best arm ends highest on both specialties together among the arms that keep the
            # node's own specialty (a gain on both paid for by the own one is not the target met)
            best = best_keeping_own(
                swarm_rows,
                gain=lambda row: row["both_gain_points_vs_silo"]["mean"],
                keeps_own=lambda row: row["own_gain_points_vs_silo"]["mean"] >= -OWN_SKILL_TOLERANCE_POINTS,
            )
            summary["best_arm"] = best
            summary["seeds"] = table[best]["seeds"]
            summary["both_gain_points_per_seed"] = table[best]["both_gain_points_vs_silo"]["per_seed"]
            summary["own_gain_points_per_seed"] = table[best]["own_gain_points_vs_silo"]["per_seed"]
            summary["own_gain_points_per_node_and_seed"] = table[best]["own_gain_points_per_node_and_seed"]
            twins = silo_twin_differences(silo, table[best]["seeds"], table[best]["budget_s"])
            differences = [d for per_seed in twins.values() for d in per_seed]
            summary["own_silo_twin_difference_points_per_seed"] = twins
            # the twins' differences have mean 0 by construction: their root mean square is the spread of a
            # node-against-node difference that no sharing made
            summary["own_silo_twin_rms_points"] = (
                round(math.sqrt(statistics.fmean(d * d for d in differences)), 1) if differences else None
            )
            print(
                f"  the silo's twins (nodes warm-started alike), own specialty over the last third, first less second, "
                f"points per seed: {twins}; root mean square {summary['own_silo_twin_rms_points']}; a node alone "
                f"ends more than 2 points under its twin in {sum(abs(d) > 2 for d in differences)} of "
                f"{2 * len(differences)} ordered comparisons",
                flush=True,
            )
            summary["heldout_gain_weak_points_per_seed"] = table[best]["weak_gain_points_vs_silo"]["per_seed"]
            summary["speedup_per_seed"] = table[best]["speedup"]["per_seed"]
            summary["speedup_with_network_per_seed"] = table[best]["speedup_with_network"]["per_seed"]
        if args.plot:
            plot(spec_arms, args.plot, args.axis, args.baseline)
    # homogeneous: never below the silo
    homo = {arm: seeds for (setting, arm), seeds in by_key.items() if setting == "homogeneous"}
    if "silo" in homo:
        summary.update(homogeneous_ratios(homo, summary.get("best_arm"), named))
    pretrained = {arm: seeds for (setting, arm), seeds in by_key.items() if setting == "pretrained"}
    if "silo" in pretrained:
        summary.update(pretrained_gains(pretrained))
    # sparse: SAPO's cumulative reward ratio, against the paper's silo and ours, at each horizon run; the summary's
    # per-seed fields keep the horizon with the most seeds of the paper's two arms (then the longest)
    horizons: dict[int, dict[str, list[float]]] = {}
    for rounds, sparse in sorted(sparse_by_rounds.items()):
        for name, silo_arm in (
            ("sapo_ratio_vs_paper_silo_per_seed", "paper_silo"),
            ("sapo_ratio_vs_our_silo_per_seed", "silo"),
        ):
            if "paper_sapo" in sparse and silo_arm in sparse:
                common = sorted(set(sparse["paper_sapo"]) & set(sparse[silo_arm]))
                horizons.setdefault(rounds, {})[name] = [
                    statistics.fmean(sparse["paper_sapo"][s]["cumulative_reward"])
                    / statistics.fmean(sparse[silo_arm][s]["cumulative_reward"])
                    for s in common
                ]
                ratios = [round(r, 3) for r in horizons[rounds][name]]
                print(
                    f"sparse, {rounds} rounds: paper's 4/4 cumulative reward / {silo_arm}, seeds {common}: {ratios}",
                    flush=True,
                )
    if horizons:
        kept = max(horizons, key=lambda r: (len(horizons[r].get("sapo_ratio_vs_paper_silo_per_seed", [])), r or 0))
        summary.update(horizons[kept])
        summary["sparse_rounds"] = kept
        summary["sparse_by_rounds"] = {str(r): ratios for r, ratios in horizons.items()}
    if "silo" in spec_arms and args.axis == "cpu":  # compute units are load-free already
        summary["load_matched"] = load_matched(spec_arms)
    print(json.dumps(summary))


def round_cost_against(lines: list[dict], baseline: str) -> dict | None:
    """The round-cost ratios of the newest --round-cost line measured against `baseline` (an arm, or a variant by its
    full label), keyed by the labels the report prints: a line run with --set swarm.own_replay=4 is a line of
    `silo_imitate[own_replay=4]` and `sapo_balance_gated[own_replay=4]`, not of the arms without replay."""
    for line in reversed(lines):
        ratios = line.get("round_cost_ratio_vs_silo")
        if not ratios:
            continue
        overrides = line.get("overrides") or []
        # lines from before round_cost_baseline was recorded took their ratios against the plain silo
        measured_against = arm_label({"arm": line.get("round_cost_baseline", "silo"), "overrides": overrides})
        if measured_against == baseline:
            return {arm_label({"arm": arm, "overrides": overrides}): ratio for arm, ratio in ratios.items()}
    return None


def best_keeping_own(rows: dict, gain: Callable[[dict], float], keeps_own: Callable[[dict], bool]) -> str | None:
    """The arm with the highest `gain` among those that keep the node's own specialty, or among all of them where none
    does (the report then says so)."""
    keeping = {arm: row for arm, row in rows.items() if keeps_own(row)}
    if rows and not keeping:
        print(f"no arm keeps the own specialty within {OWN_SKILL_TOLERANCE_POINTS} points of the silo's", flush=True)
    candidates = keeping or rows
    return max(candidates, key=lambda arm: gain(candidates[arm]), default=None)


def on_most_seeds(by_arm: dict, seeds_of: Callable[[object], list]) -> dict:
    """The arms run on the most seeds: a pilot on fewer seeds must not outrank a result on more."""
    most = max((len(seeds_of(value)) for value in by_arm.values()), default=0)
    return {arm: value for arm, value in by_arm.items() if len(seeds_of(value)) == most}


def homogeneous_ratios(homo: dict, best_arm: str | None, named: Collection[str] = ()) -> dict:
    """Equal nodes: each arm's mean held-out over its 4 nodes divided by the silo's, per seed, at the smaller budget of
    the two; the summary's per-seed ratios are those of the specialists' best arm, or (a report of equal nodes alone)
    of the swarm arm with the highest mean ratio among those run on the most seeds."""
    ratios = {}
    for arm, seeds in homo.items():
        common = sorted(set(seeds) & set(homo["silo"]))
        ratios[arm] = []
        for s in common:
            budget = min(seeds[s]["budget_s"], homo["silo"][s]["budget_s"])
            ratios[arm].append(mean_metric(seeds[s], budget, "all") / mean_metric(homo["silo"][s], budget, "all"))
        print(
            f"homogeneous: {arm} held-out ratio to silo at equal compute, per seed "
            f"{[round(r, 3) for r in ratios[arm]]}",
            flush=True,
        )
    if best_arm is None:
        swarm_ratios = {arm: r for arm, r in ratios.items() if may_be_best(arm, named) and r}
        swarm_ratios = on_most_seeds(swarm_ratios, lambda per_seed: per_seed)
        best_arm = max(swarm_ratios, key=lambda arm: statistics.fmean(swarm_ratios[arm]), default=None)
    return {
        "homogeneous_arm": best_arm,
        "homogeneous_ratio_per_seed": ratios.get(best_arm) if best_arm else None,
        "homogeneous_ratios": ratios,
    }


def pretrained_gains(arms: dict) -> dict:
    """Equal nodes of a pretrained model: each arm's held-out (mean of its nodes, every task) at the start and at the
    smaller budget of the arm and the silo, per seed, and its gain over the silo there in points."""
    rows = {}
    for arm, seeds in sorted(arms.items()):
        common = sorted(set(seeds) & set(arms["silo"]))
        per_seed = []
        for s in common:
            budget = min(seeds[s]["budget_s"], arms["silo"][s]["budget_s"])
            start, final = mean_metric(seeds[s], 0.0, "all"), mean_metric(seeds[s], budget, "all")
            silo_final = mean_metric(arms["silo"][s], budget, "all")
            per_seed.append(
                {
                    "seed": s,
                    "budget": budget,
                    "start": round(start, 4),
                    "final": round(final, 4),
                    "gain_points": round(100 * (final - start), 1),
                    "vs_silo_points": round(100 * (final - silo_final), 1),
                    "nodes_final": [round(node_metric(seeds[s], i, budget, "all"), 3) for i in range(NODES)],
                }
            )
        rows[arm] = per_seed
        print(f"pretrained: {arm}, held-out (mean of {NODES} nodes) at equal compute, per seed {per_seed}", flush=True)
    return {"pretrained": rows}


def four_specialists(by_key: dict, named: Collection[str] = ()) -> dict:
    """--setting four: each node's mean held-out over the four specialties at the budget, against the silo's node of
    the same index and seed (the same warm start), and the worst specialty of each."""
    four = {arm: seeds for (setting, arm), seeds in by_key.items() if setting == "four"}
    if "silo" not in four:
        return {"four_specialists_gain_points_per_node_and_seed": None}
    silo, out = four["silo"], {}
    for arm, seeds in sorted(four.items()):
        common = sorted(set(seeds) & set(silo))
        if not common:
            continue
        budget = min(seeds[s]["budget_s"] for s in common)

        def final(run: dict, node: int, key: str) -> float:
            return at_compute(run["curves"][node], key, budget)

        gains = [[100 * (final(seeds[s], i, "all") - final(silo[s], i, "all")) for i in range(NODES)] for s in common]
        worst = [[min(final(seeds[s], i, label) for label in FOUR_SPECIALTIES) for i in range(NODES)] for s in common]
        by_specialty = {
            label: statistics.fmean(final(seeds[s], i, label) for s in common for i in range(NODES))
            for label in FOUR_SPECIALTIES
        }
        own = statistics.fmean(final(seeds[s], i, seeds[s]["own"][i]) for s in common for i in range(NODES))
        out[arm] = {
            "seeds": common,
            "mean_final": statistics.fmean(final(seeds[s], i, "all") for s in common for i in range(NODES)),
            "own_final": own,
            "by_specialty_final": by_specialty,
            "gain_points_per_node_and_seed": gains,
            "gain_points_mean": statistics.fmean(g for per_seed in gains for g in per_seed),
            "worst_specialty_per_node_and_seed": worst,
            "own_gain_points_per_node_and_seed": own_gain_per_node(seeds, silo, common, budget),
            "rounds_per_node": statistics.fmean(r for s in common for r in seeds[s]["rounds"]),
        }
        print(
            f"four specialists: {arm:13s} seeds {common}: 4-specialty mean {out[arm]['mean_final']:.3f} "
            f"({out[arm]['gain_points_mean']:+.1f} points vs silo; per seed, per node "
            f"{[[round(g, 1) for g in per_seed] for per_seed in gains]}), own {own:.3f}, by specialty "
            f"{ {label: round(v, 3) for label, v in by_specialty.items()} }, worst per node "
            f"{[[round(w, 3) for w in per_seed] for per_seed in worst]}, own specialty vs the same node alone over "
            f"the budget's last third, points per seed and node {out[arm]['own_gain_points_per_node_and_seed']}",
            flush=True,
        )
    swarm = {arm: row for arm, row in out.items() if may_be_best(arm, named)}
    best = best_keeping_own(
        swarm,
        gain=lambda row: row["gain_points_mean"],
        # every node keeps its own specialty on the mean of its seeds
        keeps_own=lambda row: all(
            statistics.fmean(per_node) >= -OWN_SKILL_TOLERANCE_POINTS
            for per_node in zip(*row["own_gain_points_per_node_and_seed"].values())
        ),
    )
    return {
        "four_specialists": out,
        "four_specialists_best_arm": best,
        "four_specialists_gain_points_per_node_and_seed": out[best]["gain_points_per_node_and_seed"] if best else None,
        "four_specialists_own_gain_points_per_node_and_seed": (
            out[best]["own_gain_points_per_node_and_seed"] if best else None
        ),
    }


def mean_at_round(run: dict, round_: float, which: str) -> float:
    keys = [
        (
            run["weak"][i]
            if which == "weak"
            else next(label for label in SPECIALTIES if label != run["weak"][i])
            if which == "own"
            else "all"
        )
        for i in range(NODES)
    ]
    return statistics.fmean(interpolate(run["curves"][i], keys[i], "round", round_) for i in range(NODES))


def load_matched(spec_arms: dict) -> dict:
    """Each arm against the silo of its seeds when their runs did not share the machine's load (CPU seconds a round
    move with it): the arm's CPU cost a round relative to a silo run that overlapped it in time gives the rounds it
    would have run in the silo's budget at the silo's load; its held-out at that round against the silo's at its end."""

    def span(run):
        return run["finished"] - run["wall_s"], run["finished"]

    def cost(run):
        return statistics.fmean(c / r for c, r in zip(run["compute_s"], run["rounds"]))

    silo, out = spec_arms["silo"], {}
    for arm, seeds in sorted(spec_arms.items()):
        if arm == "silo":
            continue
        for seed, run in sorted(seeds.items()):
            beside = [q for q in silo.values() if span(q)[0] < span(run)[1] and span(run)[0] < span(q)[1]]
            if seed not in silo or not beside:
                continue
            ratio = cost(run) / statistics.fmean(cost(q) for q in beside)
            rounds = statistics.fmean(silo[seed]["rounds"]) / ratio
            row = {"cost_ratio_vs_silo_beside": ratio, "rounds_at_silo_budget": rounds}
            for which in ("weak", "own", "all"):
                row[which] = mean_at_round(run, rounds, which)
                row[f"{which}_gain_points_vs_silo"] = 100 * (
                    row[which] - mean_metric(silo[seed], silo[seed]["budget_s"], which)
                )
            out.setdefault(arm, {})[seed] = row
            print(
                f"load-matched {arm} seed {seed}: a round costs {ratio:.2f}x a silo round beside it, so {rounds:.0f} "
                "rounds in the silo's budget; "
                f"there weak {row['weak']:.3f} ({row['weak_gain_points_vs_silo']:+.1f} points vs silo), own "
                f"{row['own']:.3f} ({row['own_gain_points_vs_silo']:+.1f}), "
                f"both {row['all']:.3f} ({row['all_gain_points_vs_silo']:+.1f})",
                flush=True,
            )
    return out


def plot(spec_arms: dict, path: Path, axis: str, baseline: str = "silo") -> None:
    panels = (("weak", "the specialty it lacked"), ("own", "its own specialty"), ("all", "both specialties"))
    plot_panels(spec_arms, path, axis, baseline, panels, "held-out accuracy on {}", mean_metric)


def four_node_metric(run: dict, node: int, compute_s: float, which: str) -> float:
    """--setting four: 'own' the node's warm-start specialty, 'lacked' the mean of the other three, 'all' all four."""
    own = run["own"][node]
    if which == "lacked":
        lacked = [label for label in FOUR_SPECIALTIES if label != own]
        return statistics.fmean(at_compute(run["curves"][node], label, compute_s) for label in lacked)
    return at_compute(run["curves"][node], own if which == "own" else "all", compute_s)


def plot_four(four_arms: dict, path: Path, axis: str, baseline: str = "silo") -> None:
    """--setting four: held-out per specialty kind against node compute, mean of the 4 nodes and the seeds."""

    def four_mean(run: dict, compute_s: float, which: str) -> float:
        return statistics.fmean(four_node_metric(run, i, compute_s, which) for i in range(NODES))

    panels = (("lacked", "the three it lacked (mean)"), ("own", "its own specialty"), ("all", "all four (mean)"))
    plot_panels(four_arms, path, axis, baseline, panels, "four specialists: held-out on {}", four_mean)


def plot_panels(
    arms: dict,
    path: Path,
    axis: str,
    baseline: str,
    panels: tuple[tuple[str, str], ...],
    title: str,
    metric: Callable[[dict, float, str], float],
) -> None:
    """One panel per (which, name) of `panels`: each arm's `metric(run, compute, which)`, the mean of the seeds it
    shares with the silo (those the report's table compares), on 21 points of its first run's budget."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(15, 4))
    for arm, seeds in sorted(arms.items()):
        seeds = {seed: run for seed, run in seeds.items() if seed in arms.get("silo", seeds)}
        if not seeds:
            continue
        label = f"{baseline} (the silo)" if arm == "silo" and baseline != "silo" else arm
        budget = next(iter(seeds.values()))["budget_s"]
        xs = [budget * k / 20 for k in range(21)]
        for ax, (which, name) in zip(axes, panels):
            ys = [statistics.fmean(metric(run, x, which) for run in seeds.values()) for x in xs]
            ax.plot(xs, ys, label=f"{label} ({len(seeds)} seeds)")
            ax.set_title(title.format(name))
            ax.set_xlabel("node compute (compute units)" if axis == "units" else "node compute (CPU seconds)")
    axes[0].set_ylabel("greedy accuracy, mean of 4 nodes and seeds")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot written to {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--setting", choices=["specialists", "four", "homogeneous", "sparse", "pretrained"], default="specialists"
    )
    parser.add_argument(
        "--heldout-per-specialty",
        type=int,
        default=None,
        help=f"greedy held-out questions of each task ({HELDOUT_PER_SPECIALTY}; --setting pretrained: 50)",
    )
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=["silo_imitate", "sapo_balance_gated"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--budget", type=float, default=300.0, help="compute per node, on --axis (units: idle-machine CPU seconds)"
    )
    parser.add_argument(
        "--axis",
        choices=["units", "cpu"],
        default="units",
        help="the budget's axis: compute units (node/compute.py; load-free) or this process's CPU seconds; with "
        "--report: the runs of this axis",
    )
    parser.add_argument("--costs", type=Path, default=REPO / "benchmarks" / "compute_costs.json")
    parser.add_argument("--points", type=int, default=6, help="held-out evaluations along the budget")
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="run this many rounds per node instead of a compute budget (the sparse setting's SAPO ratio)",
    )
    parser.add_argument(
        "--warmup-steps",
        nargs="+",
        default=["260"],
        metavar="[LABEL=]STEPS",
        help="warm-start steps: one number, or per specialist and 'both'",
    )
    parser.add_argument("--sparse-warmup-steps", type=int, default=60)
    parser.add_argument("--config", type=Path, default=CONFIG)
    parser.add_argument("--set", action="append", default=[], help="a config override for every node of every arm")
    parser.add_argument("--results", type=Path, default=REPO / "benchmarks" / "results" / "sharing.jsonl")
    parser.add_argument("--more-results", type=Path, nargs="*", default=[], help="--report: read these files too")
    parser.add_argument(
        "--network-charge",
        type=float,
        default=0.081,
        help="network cost of a swarm round, as a fraction of a silo round",
    )
    parser.add_argument(
        "--transport",
        choices=["inprocess", "dht"],
        default="inprocess",
        help="dht: the nodes talk through real p2p daemons on 127.0.0.1; with --report: the runs of this transport",
    )
    parser.add_argument("--gate", action="store_true", help="only print the warm-start gate")
    parser.add_argument(
        "--round-cost",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="only measure what a round of each of --arms costs (ROUNDS rounds per node, arms interleaved)",
    )
    parser.add_argument("--round-cost-warmup", type=int, default=5)
    parser.add_argument(
        "--round-cost-results",
        type=Path,
        nargs="+",
        default=[REPO / "benchmarks" / "results" / "sharing_round_cost.jsonl"],
        help="--round-cost appends its JSON line to the first file; --report quotes the newest line of them all "
        "measured against --baseline",
    )
    parser.add_argument(
        "--baseline",
        default="silo",
        type=single_node_arm,
        help="--report: the single-node arm (or variant, 'silo_imitate[own_replay=4]') every arm is measured against "
        "(the best single-node recipe)",
    )
    parser.add_argument("--report", action="store_true", help="only summarize --results")
    parser.add_argument("--plot", type=Path, default=None)
    parser.add_argument("--plot-four", type=Path, default=None, help="--report: the four-specialist plot")
    parser.add_argument(
        "--report-arms",
        nargs="+",
        type=arm_or_variant,
        help="--report: only these arms (the silo among them); an arm's variant named by its full label, "
        "'sapo_balance_gated[own_replay=4]', is kept alone and may be the summary's best arm",
    )
    parser.add_argument(
        "--report-budget",
        type=float,
        default=None,
        help="--report: only runs of this --budget (they must share one axis)",
    )
    args = parser.parse_args()
    if args.heldout_per_specialty is None:
        args.heldout_per_specialty = 50 if args.setting == "pretrained" else HELDOUT_PER_SPECIALTY
    try:
        args.warmup_steps = parse_warmup_steps(args.warmup_steps)
    except (ValueError, argparse.ArgumentTypeError) as exc:
        parser.error(str(exc))
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    if args.report:
        report(args)
        return
    if args.gate:
        gate(args)
        return
    if args.round_cost:
        result = asyncio.run(round_cost(args))
        append_json_line(args.round_cost_results[0], result)
        print(json.dumps(result))
        return
    with tempfile.TemporaryDirectory() as scratch:
        for seed in args.seeds:
            for arm in args.arms:
                result = asyncio.run(run_arm(args.setting, arm, seed, args, scratch))
                append_json_line(args.results, result)
                finals = [curve[-1] for curve in result["curves"]]
                print(
                    f"{args.setting} {arm} seed {seed}: rounds {result['rounds']}, final held-out "
                    + ", ".join(
                        f"node {i} {' '.join(f'{k} {v:.2f}' for k, v in f.items() if k not in ('compute_s', 'round'))}"
                        for i, f in enumerate(finals)
                    )
                    + f", {result['wall_s']:.0f} s wall",
                    flush=True,
                )


if __name__ == "__main__":
    main()
