"""The settings and arms of benchmarks/sharing.py: the configs, each arm's overrides (ARMS), the retired arms whose
stored runs --report still reads, a node's specialties and warm start, and how a run's arm is labelled."""

from __future__ import annotations

import argparse
import re
from collections.abc import Collection

from benchmarks.common import REPO

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
    "silo_imitate": SILO_IMITATE,
    "sapo_balance": SAPO_BALANCE,
    # the shipped arm taking a peer's group only where that peer is measurably stronger in its specialty, its own
    # questions in place of the rest (issue #33 section 3's success-gated transfer): equal nodes train as silos do
    "sapo_balance_gated": [*SAPO_BALANCE, "swarm.external_gate=stronger_peer"],
    # NoLoCo as configs/swarm.yaml offers it (a random partner every 50 updates, outer lr 0.7, momentum 0.5, fp16 on
    # the wire), beside the shipped sharing and beside the silo alone (issue #33 section 3: does the averaging the
    # README offers help specialists or harm them?)
    "sapo_balance_noloco": [*SAPO_BALANCE, "averaging.method=noloco"],
    "silo_imitate_noloco": [*SILO_IMITATE, "averaging.method=noloco"],
    # the paper's baselines: zero-advantage groups kept in the batch, as SAPO's silo and 4/4 swarm trained
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
    # Variants of the shipped arms that did no better than them (their settings are still options; the arms ran up to
    # commit d890880, and the same runs are `--arms <base> --set ...` now):
    # the mix draw, no balanced draw (sapo_balance with swarm.local_draw=mix)
    "sapo_imitate": "swarm",
    # each completion its own row, before rollout.share_prompt_prefill and trainer.share_prompt_forward (silo_imitate
    # or sapo_balance with both false)
    "silo_imitate_rows": "alone",
    "sapo_balance_rows": "swarm",
    # SAPO's 6/2 (sapo_balance with 6 own questions, 2 of peers' groups, 6 generated)
    "sapo_balance_6_2": "swarm",
    # 8 own questions generated, the 4 with a reward spread trained (sapo_balance with swarm.generated_questions=8)
    "sapo_balance_gen8": "swarm",
    # the node's own right answers as its only demonstrations (sapo with swarm.imitation=own and
    # trainer.imitation_coef=4, sapo_balance with swarm.imitation=own)
    "sapo_own": "swarm",
    "sapo_balance_own": "swarm",
    # "just more sampling": 12 generated, 8 trained (silo with swarm.generated_questions=12)
    "silo12": "alone",
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
