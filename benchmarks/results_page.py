"""The results page (benchmarks/README.md): one row per claim, generated from the rows in benchmarks/results/.

    .venv/bin/python benchmarks/results_page.py            # writes benchmarks/README.md
    .venv/bin/python benchmarks/results_page.py --check    # exits 1, with a diff, where the page and the results differ

A claim (SECTIONS below) names the results files it reads (`Source`: a file and which of its rows count), the function
that reads its figure from those rows, and the rule that turns the figure into a verdict against the claim's stated
target. No figure is typed in: every number on the page is read from a file here. A file that is missing, or a filter
that matches no row, stops the script with `ResultsError`: a claim never drops out of the page silently. A mechanism
that lost keeps its row after its code is gone, since its row reads only its stored results.

The figures are read as the benchmarks' own reports read them (sharing: `benchmarks/sharing.py --report`, held-out
accuracy interpolated at the budget and averaged over a run's nodes, the newest run of each arm and seed counting;
stage_recovery: `benchmarks/stage_recovery.py --report`, ratios of means over the seeds where both strategies reached
the target). This file imports neither torch nor the node: it reads JSON.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import statistics
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent
RESULTS = BENCHMARKS / "results"
NOTEBOOK = BENCHMARKS / "notebook"
PAGE = BENCHMARKS / "README.md"
GENERATOR = ".venv/bin/python benchmarks/results_page.py"


class ResultsError(Exception):
    """A claim's results cannot be read: a file is missing or empty, or a filter matched no row."""


# sources: the rows a claim reads -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Source:
    """The rows of one file of benchmarks/results/ that a claim reads. A `.jsonl` file is one JSON object a line; of a
    `.out` file (a benchmark's printed output) the lines that are its closing JSON line (`{"benchmark": ...}`).
    `where`: the keys a row must have with these values, or a predicate it must hold (its docstring says which rows);
    `lines`: only rows `first` to `last` (1-based), for a file whose rows carry nothing else that tells them apart."""

    file: str
    where: Mapping[str, object] | Callable[[dict], bool] = field(default_factory=dict)
    lines: tuple[int, int] | None = None

    def rows(self, results: Path = RESULTS) -> list[dict]:
        path = results / self.file
        if not path.exists():
            raise ResultsError(f"{self.file}: no such file in {results}")
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        if path.suffix == ".out":
            lines = [line for line in lines if line.startswith('{"benchmark"')]
        rows = [json.loads(line) for line in lines]
        if self.lines is not None:
            rows = rows[self.lines[0] - 1 : self.lines[1]]
        if not rows:
            raise ResultsError(f"{self.file}: no rows")
        if callable(self.where):
            kept = [row for row in rows if self.where(row)]
        else:
            kept = [row for row in rows if all(row.get(key) == value for key, value in self.where.items())]
        if not kept:
            raise ResultsError(f"{self.file}: no row matches {self.described()}")
        return kept

    def described(self) -> str:
        if callable(self.where):
            return self.where.__doc__ or "its filter"
        return ", ".join(f"{key}={value!r}" for key, value in self.where.items()) or "any row"


# figures and verdicts ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Figure:
    """A claim's figure: one value per seed (or run, or node), and how to print them. `center` is the figure the
    rules read as the mean where that is not the mean of the values (a ratio of means over seeds)."""

    values: tuple[float, ...]
    unit: str  # "points", "x", "s", "MiB", "loss", or a count's noun
    per: str = "seed"  # what one value is
    note: str = ""  # a reading beside the values, e.g. how many nodes ended above their silo
    center: float | None = None
    digits: int = 2  # of a ratio or a loss
    headline: bool = True  # False: the values only, where their mean says nothing (one per transfer mode)

    def __post_init__(self):
        if not self.values:
            raise ResultsError("a figure without values")

    @property
    def mean(self) -> float:
        return statistics.fmean(self.values) if self.center is None else self.center

    def number(self, value: float) -> str:
        if self.unit == "points":
            return f"{value:+.1f}"
        if self.unit == "x":
            return f"{value:.{self.digits}f}x"
        if self.unit == "MiB":
            return f"{value:,.0f}"
        if self.unit.endswith("loss"):
            return f"{value:+.{self.digits}f}"
        if self.unit == "s":
            return f"{value:.1f}"
        return f"{value:g}"

    def text(self) -> str:
        suffix = "" if self.unit == "x" else f" {self.unit}"
        count = len(self.values)
        if not self.headline:
            listed = ", ".join(self.number(v) for v in self.values)
            return f"{listed}{suffix} ({count} {self.per}s)" + (f"; {self.note}" if self.note else "")
        if count == 1:
            spread = f"1 {self.per}"
        elif count <= 4:
            spread = ", ".join(self.number(v) for v in self.values) + f"; {count} {self.per}s"
        else:
            spread = f"{self.number(min(self.values))} .. {self.number(max(self.values))}; {count} {self.per}s"
        if self.center is not None:
            spread = "the ratio of the means; per seed " + spread
        return f"{self.number(self.mean)}{suffix} ({spread})" + (f"; {self.note}" if self.note else "")


@dataclass(frozen=True)
class AtLeast:
    """Met where every value (`of="every"`) or their mean (`of="mean"`) is at least `target` (above it: `strict`)."""

    target: float
    of: str = "every"
    strict: bool = False

    def verdict(self, figure: Figure) -> str:
        values = figure.values if self.of == "every" else (figure.mean,)
        ok = all(v > self.target if self.strict else v >= self.target for v in values)
        return "met" if ok else "not met"


@dataclass(frozen=True)
class AtMost:
    """Met where every value (or their mean) is at most `target`."""

    target: float
    of: str = "every"

    def verdict(self, figure: Figure) -> str:
        values = figure.values if self.of == "every" else (figure.mean,)
        return "met" if all(v <= self.target for v in values) else "not met"


@dataclass(frozen=True)
class Both:
    """Met where both rules are."""

    first: AtLeast | AtMost
    second: AtLeast | AtMost

    def verdict(self, figure: Figure) -> str:
        return "met" if self.first.verdict(figure) == self.second.verdict(figure) == "met" else "not met"


@dataclass(frozen=True)
class Gain:
    """A mechanism against its fair baseline, the values its difference from it (`level` 0) or their ratio (`level`
    1): met where every value is above level + tolerance, loses where the mean is under level - tolerance, no better
    where the mean is within the tolerance, mixed where the mean is above it but not every value."""

    tolerance: float
    level: float = 0.0

    def verdict(self, figure: Figure) -> str:
        if all(v > self.level + self.tolerance for v in figure.values):
            return "met"
        if figure.mean < self.level - self.tolerance:
            return "loses"
        if abs(figure.mean - self.level) <= self.tolerance:
            return "no better"
        return "mixed"


Rule = AtLeast | AtMost | Both | Gain


@dataclass(frozen=True)
class Claim:
    anchor: str  # the row's id: link to it as benchmarks/README.md#ANCHOR
    claim: str  # what is claimed, with its target
    setting: str  # the setting that ships, or the option that did not
    baseline: str  # what the figure is measured against: the fair baseline
    sources: tuple[Source, ...]
    figure: Callable[[list[list[dict]]], Figure]  # the rows of each source, in order -> the figure
    rule: Rule
    command: str
    notebook: tuple[str, str]  # the notebook page, and the start of the heading there that tells the campaign

    def read(self, results: Path = RESULTS) -> tuple[Figure, str]:
        figure = self.figure([source.rows(results) for source in self.sources])
        return figure, self.rule.verdict(figure)


# sharing: benchmarks/sharing.py's report, read without the node ------------------------------------------------------

NODES = 4
SPECIALTIES = ("add", "subtract")
LATE_POINTS = 5  # the own specialty per node: the mean of this many readings over the budget's last third


def arm_label(run: dict) -> str:
    """The arm and its --set overrides, as the sharing report labels them: `sapo_balance_gated[own_replay=4]`."""
    short = [o.partition("=")[0].split(".")[-1] + "=" + o.partition("=")[2] for o in run.get("overrides") or []]
    return run["arm"] + (f"[{','.join(short)}]" if short else "")


def interpolate(curve: list[dict], key: str, x: float) -> float:
    """The curve's `key` where its compute is `x`, linear between its evaluation points."""
    for before, after in zip(curve, curve[1:]):
        if after["compute_s"] >= x:
            span = after["compute_s"] - before["compute_s"]
            t = 0.0 if span <= 0 else (x - before["compute_s"]) / span
            return before[key] + t * (after[key] - before[key])
    return curve[-1][key]


def node_metric(run: dict, node: int, x: float, which: str) -> float:
    """'weak': the node's weak specialty; 'own': the one it was warm-started on; 'all': every specialty; else that
    specialty."""
    weak = run["weak"][node]
    own = (run.get("own") or [None] * NODES)[node] or (
        next(label for label in SPECIALTIES if label != weak) if weak else None
    )
    key = {"weak": weak, "own": own}.get(which, which) or "all"
    return interpolate(run["curves"][node], key, x)


def mean_metric(run: dict, x: float, which: str) -> float:
    return statistics.fmean(node_metric(run, node, x, which) for node in range(NODES))


def late_own(run: dict, node: int, budget: float) -> float:
    xs = [budget * (2 / 3 + k / (3 * (LATE_POINTS - 1))) for k in range(LATE_POINTS)]
    return statistics.fmean(node_metric(run, node, x, "own") for x in xs)


def on_axis(run: dict) -> dict:
    """A run read on its own axis: a compute-unit run's curves and budget in units."""
    if run.get("axis", "cpu") != "units":
        return run
    return dict(run, curves=[[{**p, "compute_s": p["units"]} for p in curve] for curve in run["curves"]])


def cut_at(run: dict, budget: float) -> dict | None:
    """A run read up to `budget` (a longer one cut there: its curves hold points at it), or None if it is shorter."""
    if run["rounds_limit"] is not None or run["budget_s"] < budget:
        return None
    if run["budget_s"] == budget:
        return run
    return dict(run, budget_s=budget, curves=[[p for p in c if p["compute_s"] <= budget * 1.01] for c in run["curves"]])


def sharing_runs(rows: Sequence[dict], setting: str, labels: str | Sequence[str], budget: float, axis: str) -> dict:
    """Seed -> the newest in-process run of the arm (`labels`: one label, or several that are one arm under other
    --set overrides) in `setting` on `axis`, read up to `budget`."""
    labels = (labels,) if isinstance(labels, str) else tuple(labels)
    runs: dict[int, dict] = {}
    for run in sorted(rows, key=lambda r: r.get("finished", 0)):
        if run.get("setting") != setting or arm_label(run) not in labels:
            continue
        if run.get("axis", "cpu") != axis or run.get("transport", "inprocess") != "inprocess":
            continue
        if (read := cut_at(on_axis(run), budget)) is not None:
            runs[run["seed"]] = read
    if not runs:
        raise ResultsError(f"no {setting} run of {' or '.join(labels)} on {axis} to {budget:g}")
    return runs


def paired(rows: list[list[dict]], setting: str, arm, against, budget: float, axis: str) -> tuple[dict, dict, list]:
    """The arm's and its baseline's runs, and the seeds both have."""
    every = [row for file_rows in rows for row in file_rows]
    ours, theirs = (sharing_runs(every, setting, labels, budget, axis) for labels in (arm, against))
    seeds = sorted(set(ours) & set(theirs))
    if not seeds:
        raise ResultsError(f"{arm} and {against}: no seed in common at {budget:g}")
    return ours, theirs, seeds


def sharing_gain(arm, against, budget: float, which: str = "all", setting: str = "specialists", axis: str = "units"):
    """Points the arm's held-out (mean of its nodes, on `which`) ends above its baseline's, per seed."""

    def figure(rows: list[list[dict]]) -> Figure:
        ours, theirs, seeds = paired(rows, setting, arm, against, budget, axis)
        return Figure(
            tuple(100 * (mean_metric(ours[s], budget, which) - mean_metric(theirs[s], budget, which)) for s in seeds),
            "points",
        )

    return figure


def homogeneous_ratio(arm, against, budget: float):
    """The arm's held-out over its baseline's (mean of the nodes, every specialty), per seed, between equal nodes."""

    def figure(rows: list[list[dict]]) -> Figure:
        ours, theirs, seeds = paired(rows, "homogeneous", arm, against, budget, "units")
        return Figure(
            tuple(mean_metric(ours[s], budget, "all") / mean_metric(theirs[s], budget, "all") for s in seeds),
            "x",
            digits=3,
        )

    return figure


def four_gain(arm, against, budget: float, which: str = "all"):
    """Four specialists, per node and seed: points the node's mean over the four specialties ends above the baseline
    node of the same warm start (`which="all"`), or its own specialty over the budget's last third (`which="own"`)."""

    def figure(rows: list[list[dict]]) -> Figure:
        ours, theirs, seeds = paired(rows, "four", arm, against, budget, "units")
        if which == "own":
            gains = [
                100 * (late_own(ours[s], n, budget) - late_own(theirs[s], n, budget))
                for s in seeds
                for n in range(NODES)
            ]
            note = f"{sum(g >= -2.0 for g in gains)} of {len(gains)} within 2 points or above"
        else:
            gains = [
                100 * (node_metric(ours[s], n, budget, "all") - node_metric(theirs[s], n, budget, "all"))
                for s in seeds
                for n in range(NODES)
            ]
            note = f"{sum(g > 0 for g in gains)} of {len(gains)} above"
        return Figure(tuple(gains), "points", per="node", note=f"{len(seeds)} seeds; {note}")

    return figure


# stage_recovery: benchmarks/stage_recovery.py's report --------------------------------------------------------------


def fair_checkfree(row: dict) -> bool:
    """the fair campaign: baselines without CheckFree+ (--plain-baselines), CheckFree+ swapping the first pair only"""
    key = row.get("key", {})
    return bool(key.get("plain_baselines")) and "pipeline.checkfree_plus_swap_last=false" in key.get("settings", [])


def recovery_ratio(rate: float, other: str):
    """`other`'s wall seconds to the target over CheckFree's: the ratio of the means over the seeds where both reached
    it (what the report prints), and per seed."""

    def figure(rows: list[list[dict]]) -> Figure:
        runs = [r for r in rows[0] if abs(r["rate"] - rate) < 1e-9 and r["wall_s_to_target"]]
        by = {s: {r["seed"]: r["wall_s_to_target"] for r in runs if r["strategy"] == s} for s in ("checkfree", other)}
        seeds = sorted(set(by["checkfree"]) & set(by[other]))
        if not seeds:
            raise ResultsError(f"stage_recovery at {rate:.0%}: no seed where checkfree and {other} reached the target")
        of_means = statistics.fmean(by[other][s] for s in seeds) / statistics.fmean(by["checkfree"][s] for s in seeds)
        return Figure(tuple(by[other][s] / by["checkfree"][s] for s in seeds), "x", center=of_means)

    return figure


# other benchmarks: small readers ------------------------------------------------------------------------------------


def values(read: Callable[[dict], Sequence[float] | float], unit: str, per: str = "seed", note=None):
    """Every row's values (`read` gives one number or a list), in file order."""

    def figure(rows: list[list[dict]]) -> Figure:
        out: list[float] = []
        for row in rows[0]:
            got = read(row)
            out.extend(got if isinstance(got, (list, tuple)) else [got])
        return Figure(tuple(out), unit, per=per, note=note(rows[0]) if note else "")

    return figure


def newest(read: Callable[[dict], float], unit: str, per: str = "run", note=None):
    """The last row's value."""

    def figure(rows: list[list[dict]]) -> Figure:
        return Figure((read(rows[0][-1]),), unit, per=per, note=note(rows[0][-1]) if note else "")

    return figure


def replay_difference(rows: list[list[dict]]) -> Figure:
    """Held-out after 100 units with replay less without, per seed (the two rows' seeds in order)."""
    (without,), (with_replay,) = rows
    if without["seeds"] != with_replay["seeds"]:
        raise ResultsError("isolated_learning_units.jsonl: the two runs' seeds differ")
    pairs = zip(with_replay["heldout_accuracy_after"], without["heldout_accuracy_after"])
    return Figure(tuple(100 * (a - b) for a, b in pairs), "points")


def pretrained_run(row: dict, stages: int, recovery: str) -> dict:
    run = next((r for r in row["runs"] if r["stages"] == stages and r["recovery"] == recovery), None)
    if run is None:
        raise ResultsError(f"pipeline_pretrained.jsonl: no {stages}-stage {recovery} run")
    return run


def pretrained_loss_gap(rows: list[list[dict]]) -> Figure:
    """Training loss at the last step: random re-initialisation's less CheckFree's (negative: CheckFree ended worse)."""
    ours = pretrained_run(rows[0][0], 4, "checkfree")
    theirs = pretrained_run(rows[0][0], 4, "random")
    return Figure(
        (theirs["loss_last"] - ours["loss_last"],),
        "loss",
        per="seed",
        note=f"loss at step {ours['steps']}: CheckFree {ours['loss_last']:.2f}, random {theirs['loss_last']:.2f}",
    )


def pretrained_vs_checkpoint(rows: list[list[dict]]) -> Figure:
    """Validation loss at the failure-free run's last evaluation step: CheckFree's less checkpoint-restart's, per seed
    (positive: CheckFree is behind)."""

    def val_at(run: dict, step: int) -> float:
        point = next((p for p in run["curve"] if p["step"] >= step), None)
        if point is None:
            raise ResultsError(f"stage_recovery_smollm2.jsonl: {run['strategy']} has no evaluation at step {step}")
        return point["val_loss"]

    step = max(p["step"] for r in rows[0] if r["strategy"] == "none" for p in r["curve"])
    by = {(r["seed"], r["strategy"]): r for r in rows[0]}
    seeds = sorted({seed for seed, strategy in by if strategy == "checkfree" and (seed, "checkpoint") in by})
    if not seeds:
        raise ResultsError("stage_recovery_smollm2.jsonl: no seed with both CheckFree and checkpoint-restart")
    gaps = tuple(val_at(by[(s, "checkfree")], step) - val_at(by[(s, "checkpoint")], step) for s in seeds)

    def wall(seed: int, strategy: str) -> str:
        seconds = by[(seed, strategy)]["wall_s_to_target"]
        return f"{seconds:.0f} s" if seconds else "missed"

    return Figure(
        gaps,
        "loss",
        per="seed",
        note=f"validation at step {step}; to the target: checkpoint-restart "
        f"{', '.join(wall(s, 'checkpoint') for s in seeds)}, "
        f"CheckFree {', '.join(wall(s, 'checkfree') for s in seeds)}",
    )


def pretrained_two_stages(rows: list[list[dict]]) -> Figure:
    """The loss before the failure less the loss at the end (negative: it ended higher than before the failure)."""
    run = pretrained_run(rows[0][0], 2, "checkfree")
    return Figure(
        (run["loss_before_failure"] - run["loss_last"],),
        "loss",
        per="seed",
        note=f"loss {run['loss_before_failure']:.2f} before the failure, {run['loss_last']:.2f} at step {run['steps']}"
        f" (validation {run['val_loss_end']:.2f})",
    )


def swap_cost(rows: list[list[dict]]) -> Figure:
    """Validation loss without CheckFree+'s swaps less with them (as shipped), 27M, 60 steps from the same weights."""
    check = next(c for c in rows[0][-1]["loss_check"] if c["size"] == "27M")
    return Figure(
        (check["val_loss"]["nocfp"] - check["val_loss"]["plain"],),
        "validation loss",
        per="run",
        note=f"validation {check['val_loss']['plain']:.3f} with the swaps, {check['val_loss']['nocfp']:.3f} without",
    )


def lab_vs_one_process(variant: str, mbit: float):
    def figure(rows: list[list[dict]]) -> Figure:
        runs = rows[0][-1]["lab"]["27M"]["runs"]
        run = next((r for r in runs if r["variant"] == variant and r["mbit"] == mbit), None)
        if run is None:
            raise ResultsError(f"no lab run of {variant} at {mbit:g} Mbit/s")
        return Figure((run["vs_one_process"],), "x", per="run", note=f"step {run['step_s']:.2f} s")

    return figure


def newest_sync_by_mode(rows: list[list[dict]]) -> Figure:
    """Each transfer mode's newest sync time (the median of its peer-rounds), int4, fp16, fp32."""
    newest_of: dict[str, dict] = {}
    for row in sorted(rows[0], key=lambda r: r["date"]):
        newest_of[row["mode"]] = row
    modes = [m for m in ("int4", "fp16", "fp32") if m in newest_of]
    return Figure(
        tuple(newest_of[m]["noloco_sync_s"]["2"] for m in modes),
        "s",
        per="transfer mode",
        note=", ".join(modes),
        headline=False,
    )


def mixed_pair(rows: list[list[dict]]) -> Figure:
    """The questions each node of the pair trained on from the other (SmolLM2's node, the default model's)."""
    nodes = rows[0][-1]["nodes"]
    return Figure(
        (nodes["smollm2"]["external_questions"], nodes["default"]["external_questions"]),
        "questions",
        per="node",
        note="SmolLM2's node first",
        headline=False,
    )


def crowd_round_ratio(rows: list[list[dict]]) -> Figure:
    """The median round at M = 1,024 over the median round at M = 4, per run."""
    ratios = []
    for file_rows in rows:
        row = file_rows[-1]
        by_size = dict(zip(row["sizes"], row["round_s_by_size"]))
        ratios.append(by_size[1024] / by_size[4])
    return Figure(tuple(ratios), "x", per="run")


def gpu_rounds(rows: list[list[dict]]) -> Figure:
    """A CUDA float32 node's rounds a second over the same node's on that machine's CPU."""
    arms = {(a["device"].split(":")[0], a["dtype"]): a["rounds_per_s"] for a in rows[0][0]["arms"]}
    return Figure((arms[("cuda", "float32")] / arms[("cpu", "float32")],), "x", per="run")


def gpu_bfloat16(rows: list[list[dict]]) -> Figure:
    """bfloat16's rounds a second over float32's on the same GPU, per run."""
    ratios = []
    for row in rows[0]:
        arms = {a["dtype"]: a["rounds_per_s"] for a in row["arms"] if a["device"].startswith("cuda")}
        ratios.append(arms["bfloat16"] / arms["float32"])
    return Figure(tuple(ratios), "x", per="run", digits=3)


# the claims ----------------------------------------------------------------------------------------------------------

WARM = "--warmup-steps add=125 subtract=230 both=260"
SHIPPED_TWO = "sapo_balance_gated[own_replay=4]"  # the shipped sharing, as the sharing report labels its runs
SMOLLM2_SHARING = "sapo_balance[own_replay=4]"  # configs/smollm2_swarm.yaml's sharing: no gate between equal nodes
ALONE_4 = "silo_imitate[own_replay=4]"  # the best a node does alone: the isolated default's recipe
SPECIALISTS = "`configs/specialists.yaml`"
# the last commit that holds the code of the mechanisms that lost and left the product (issue #72): their commands run
# there, and their rows here read only their stored results
REMOVED_AT = "f6ffaf2"


def removed(knobs: str) -> str:
    """The setting cell of a mechanism that lost and left the product."""
    return f"{knobs} (removed; code at {REMOVED_AT})"


SECTIONS: list[tuple[str, list[Claim]]] = []


def section(title: str, *claims: Claim) -> None:
    SECTIONS.append((title, list(claims)))


def sharing_command(arguments: str, results: str) -> str:
    return f"`benchmarks/sharing.py {arguments} {WARM} --results benchmarks/results/{results}`"


def four_stages(row: dict) -> bool:
    """the 4-stage runs"""
    return row["settings"]["stages"] == [4]


def two_stages(row: dict) -> bool:
    """the 2-stage runs"""
    return row["settings"]["stages"] == [2]


section(
    "A node alone",
    Claim(
        "isolated-default",
        "A node alone learns on the default model: held-out +10 points on every seed in 100 compute units",
        "`configs/isolated.yaml` (the built-in defaults)",
        "its own start (held-out before training)",
        (Source("isolated_learning_units.jsonl", {"overrides": ["torch_threads=1", "swarm.own_replay=4"]}),),
        values(lambda r: r["heldout_gain_points"], "points"),
        AtLeast(10.0),
        "`benchmarks/isolated_learning.py --units 100 --eval-every-units 10 --seeds 0 1 2 --set torch_threads=1 "
        "--set swarm.own_replay=4 --results benchmarks/results/isolated_learning_units.jsonl`",
        ("2026-11-28-sharing-compute-units", "A node alone replays too"),
    ),
    Claim(
        "isolated-replay",
        "Replaying 4 of its earlier right answers a round adds to a node alone's held-out (default model, 100 units)",
        "`swarm.own_replay: 4` (the default)",
        "the same node without replay",
        (
            Source("isolated_learning_units.jsonl", {"overrides": ["torch_threads=1"]}),
            Source("isolated_learning_units.jsonl", {"overrides": ["torch_threads=1", "swarm.own_replay=4"]}),
        ),
        replay_difference,
        Gain(2.0),
        "the row above, with and without `--set swarm.own_replay=4`",
        ("2026-11-28-sharing-compute-units", "A node alone replays too"),
    ),
    Claim(
        "isolated-imitation",
        "Learning its own right answers as demonstrations adds to GRPO alone (two specialists' nodes alone, both "
        "operations, 200 units, a row per completion)",
        "`swarm.imitation: own`, `trainer.imitation_coef: 4` (the defaults)",
        "plain GRPO alone (arm `silo`)",
        (Source("sharing.jsonl"),),
        sharing_gain("silo_imitate", "silo", 200),
        Gain(2.0),
        f"`benchmarks/sharing.py --arms silo_imitate silo --seeds 0 1 2 --budget 200 --points 5 {WARM}`",
        ("2026-11-28-sharing-compute-units", "Specialists at 200 compute units per node"),
    ),
    Claim(
        "smollm2-alone",
        "SmolLM2-135M-Instruct learns alone: held-out +10 points on every seed in 40 rounds",
        "`configs/smollm2.yaml`",
        "its own start (held-out before training)",
        (Source("isolated_smollm2.jsonl", {"config": "smollm2.yaml"}),),
        values(lambda r: r["heldout_gain_points"], "points"),
        AtLeast(10.0),
        "`benchmarks/isolated_learning.py --config configs/smollm2.yaml --seeds S --rounds 40 --results "
        "benchmarks/results/isolated_smollm2.jsonl`",
        ("2026-12-02-smollm2", "It learns alone"),
    ),
    Claim(
        "smollm2-sampler",
        "On SmolLM2 our sampler generates at least 1.5x the tokens a second of `model.generate`",
        "`rollout.drop_finished_rows`, `rollout.share_prompt_prefill` (the defaults)",
        "`model.generate` on the same prompts and lengths, side by side",
        (Source("rollout_throughput_smollm2.jsonl", {"config": "smollm2.yaml"}),),
        newest(lambda r: r["ratio_backend_vs_generate"], "x", per="run, the median of 3 repeats"),
        AtLeast(1.5),
        "`benchmarks/rollout_throughput.py --config configs/smollm2.yaml --repeats 3 --rounds 2 --update-repeats 1 "
        "--results benchmarks/results/rollout_throughput_smollm2.jsonl`",
        ("2026-12-02-smollm2", "Throughput"),
    ),
    Claim(
        "smollm2-memory",
        "A SmolLM2 node's resident memory peaks under 3.5 GiB (3,584 MiB) over an hour of training",
        "`configs/smollm2.yaml` (gradient checkpointing, the allocator's fixed mmap threshold)",
        "the target",
        (Source("node_memory.jsonl", {"isolated": "configs/smollm2.yaml"}),),
        newest(
            lambda r: r["max_peak_mib"], "MiB", note=lambda r: f"resident at 60 min over at 5 min x{r['max_ratio']:.2f}"
        ),
        AtMost(3584.0),
        "`benchmarks/node_memory.py --minutes 60 --isolated configs/smollm2.yaml --results "
        "benchmarks/results/node_memory.jsonl`",
        ("2026-12-02-smollm2", "Memory"),
    ),
    Claim(
        "overlap",
        "Generating the next round during the update (rollout.max_staleness 1) gives a node alone at least 1.5x the "
        "rounds a wall-clock second of the serial round, held-out at equal compute at most 1 point below on every seed",
        "an option, off (`rollout.max_staleness: 0`)",
        "the serial round, same config, seed and questions, run just before it; both at torch_threads 1 (their best on "
        "2 cores: the serial round runs 4.4 rounds/s at 1 thread, 1.8-3.6 at torch's default 2)",
        (Source("overlap.jsonl", {"settings": ["torch_threads=1"]}),),
        values(
            lambda r: r["ratio"],
            "x",
            note=lambda rows: (
                "held-out at equal compute "
                + ", ".join(f"{100 * (r['ahead_heldout_equal_compute'] - r['serial_heldout']):+.1f}" for r in rows)
                + " points, at equal wall clock "
                + ", ".join(f"{100 * (r['ahead_heldout_equal_wall'] - r['serial_heldout']):+.1f}" for r in rows)
            ),
        ),
        AtLeast(1.5),
        "`benchmarks/overlap.py --seeds 3 --rounds 40 --set torch_threads=1 --results "
        "benchmarks/results/overlap.jsonl`",
        ("2026-12-02-overlap", "Generating during the update"),
    ),
    Claim(
        "partial-rollouts",
        "Partial rollouts (rollout.over_sample 0.5, APRIL) give a node alone on a long-tail workload at least 1.2x the "
        "completions a second of generation of the node without them",
        "an option, off (`rollout.over_sample: 0`)",
        "the same config, seed and questions without partial rollouts, in turns a round each in one process; all at "
        "torch_threads 1",
        (Source("partial_rollouts.jsonl", {"settings": ["torch_threads=1"], "over_sample": 0.5}),),
        values(
            lambda r: r["throughput_ratio_keep"],
            "x",
            note=lambda rows: (
                "partial_prefix keep; held-out after 40 rounds each (the partial arms spent ~1.2x the compute units) "
                + ", ".join(f"{100 * r['heldout_keep_minus_without']:+.1f}" for r in rows)
                + " points; with drop_finished_rows false 0.97-1.07x (the notebook)"
            ),
        ),
        AtLeast(1.2),
        "`benchmarks/partial_rollouts.py --seeds 3 --rounds 40 --set torch_threads=1 --results "
        "benchmarks/results/partial_rollouts.jsonl`",
        ("2026-12-02-partial-rollouts", "2026-12-02: partial rollouts (APRIL) on a long-tail workload"),
    ),
)

TWO = (Source("sharing_replay_specialists.jsonl"), Source("sharing_silo_replay_specialists.jsonl"))
TWO_COMMAND = (
    sharing_command(
        "--setting specialists --arms sapo_balance_gated --set swarm.own_replay=4 --seeds S --budget 600 --points 6",
        "sharing_replay_specialists.jsonl",
    )
    + f", the same with `--arms silo_imitate`, then `--report --baseline '{ALONE_4}'`"
)
FOUR = (Source("sharing_four_replay8.jsonl"), Source("sharing_four_silo_replay8.jsonl"))
section(
    "Sharing between nodes (the default model, and one SmolLM2 run)",
    Claim(
        "sharing-two-specialists",
        "Two specialists in a swarm end above the best a node does alone on both operations, by at least +5 points "
        "on every seed, at 600 compute units",
        f"{SPECIALISTS}: `swarm.external_gate: stronger_peer`, `swarm.own_replay: 4`",
        "a node alone with the same recipe (its own right answers as demonstrations, 4 replayed a round)",
        TWO,
        sharing_gain(SHIPPED_TWO, ALONE_4, 600),
        AtLeast(5.0),
        TWO_COMMAND,
        ("2026-11-28-sharing-compute-units", "A node alone replays too"),
    ),
    Claim(
        "sharing-two-specialists-300",
        "... and at 300 compute units",
        SPECIALISTS,
        "the same",
        TWO,
        sharing_gain(SHIPPED_TWO, ALONE_4, 300),
        AtLeast(5.0),
        "the row above, read at 300 (`--report-budget 300`)",
        ("2026-11-28-sharing-compute-units", "A node alone replays too"),
    ),
    Claim(
        "sharing-two-specialists-own",
        "... keeping its own operation: at most 2 points under a node alone on the mean, at 600 units",
        SPECIALISTS,
        "the same",
        TWO,
        sharing_gain(SHIPPED_TWO, ALONE_4, 600, "own"),
        AtLeast(-2.0, of="mean"),
        "the row above",
        ("2026-11-28-sharing-compute-units", "A node alone replays too"),
    ),
    Claim(
        "sharing-two-specialists-own-200",
        "... and at 200 units",
        SPECIALISTS,
        "the same",
        TWO,
        sharing_gain(SHIPPED_TWO, ALONE_4, 200, "own"),
        AtLeast(-2.0, of="mean"),
        "the row above, read at 200",
        ("2026-11-28-sharing-compute-units", "A node alone replays too"),
    ),
    Claim(
        "sharing-two-specialists-weak",
        "... and at least +10 points on the operation it lacked, at 600 units",
        SPECIALISTS,
        "the same",
        TWO,
        sharing_gain(SHIPPED_TWO, ALONE_4, 600, "weak"),
        AtLeast(10.0, of="mean"),
        "the row above",
        ("2026-11-28-sharing-compute-units", "A node alone replays too"),
    ),
    Claim(
        "sharing-four-specialists",
        "Four specialists: every node ends above a node alone on the mean of the four skills, on every seed, and the "
        "mean gain is at least +5 points (300 units)",
        "`configs/four_specialists.yaml`: the gate, `swarm.own_replay: 8`",
        "a node alone replaying 8 (alone, the better recipe for its own skill)",
        FOUR,
        four_gain("sapo_balance_gated[own_replay=8]", "silo_imitate[own_replay=8]", 300),
        Both(AtLeast(0.0, strict=True), AtLeast(5.0, of="mean")),
        sharing_command(
            "--setting four --arms sapo_balance_gated --set swarm.own_replay=8 --seeds S --budget 300 --points 3",
            "sharing_four_replay8.jsonl",
        )
        + ", the same with `--arms silo_imitate`, then `--report --baseline 'silo_imitate[own_replay=8]'`",
        ("2026-11-28-sharing-compute-units", "Eight replays between four specialists"),
    ),
    Claim(
        "sharing-four-specialists-own",
        "... each node keeping its own skill within 2 points of a node alone (the budget's last third)",
        "`configs/four_specialists.yaml`",
        "the same",
        FOUR,
        four_gain("sapo_balance_gated[own_replay=8]", "silo_imitate[own_replay=8]", 300, "own"),
        AtLeast(-2.0),
        "the row above",
        ("2026-11-28-sharing-compute-units", "Eight replays between four specialists"),
    ),
    Claim(
        "sharing-four-specialists-vs-replay4",
        "... and above a node alone replaying 4 (the built-in default), every node, mean at least +5",
        "`configs/four_specialists.yaml`",
        "a node alone replaying 4",
        (Source("sharing_four_replay8.jsonl"), Source("sharing_four_silo_replay.jsonl")),
        four_gain("sapo_balance_gated[own_replay=8]", ALONE_4, 300),
        Both(AtLeast(0.0, strict=True), AtLeast(5.0, of="mean")),
        f"the row above, with `--baseline '{ALONE_4}'`",
        ("2026-11-28-sharing-compute-units", "Eight replays between four specialists"),
    ),
    Claim(
        "sharing-equal-nodes",
        "Between equal nodes (warm-started alike) sharing adds to a node alone (held-out ratio, 200 units)",
        "`configs/swarm.yaml`: the gate, `swarm.own_replay: 4`",
        "a node alone replaying 4",
        (Source("sharing_replay_homogeneous.jsonl"), Source("sharing_silo_replay_homogeneous.jsonl")),
        homogeneous_ratio(SHIPPED_TWO, ALONE_4, 200),
        Gain(0.02, level=1.0),
        sharing_command(
            "--setting homogeneous --arms sapo_balance_gated --set swarm.own_replay=4 --seeds S --budget 200 "
            "--points 4",
            "sharing_replay_homogeneous.jsonl",
        )
        + ", the same with `--arms silo_imitate`",
        ("2026-11-28-sharing-compute-units", "A node alone replays too"),
    ),
    Claim(
        "sharing-smollm2",
        "On SmolLM2 (four equal nodes from its pretrained weights) sharing ends above a node alone on held-out, at 800 "
        "compute units a node",
        "`configs/smollm2_swarm.yaml` (no gate), `swarm.own_replay: 4`",
        "a node alone with `configs/smollm2.yaml`'s recipe (its own right answers as demonstrations, 4 replayed)",
        (Source("sharing_smollm2.jsonl"),),
        sharing_gain(SMOLLM2_SHARING, ALONE_4, 800, setting="pretrained"),
        Gain(2.0),
        "`benchmarks/sharing.py --setting pretrained --arms sapo_balance --seeds S --budget 800 --points 1 --set "
        "swarm.own_replay=4 --results benchmarks/results/sharing_smollm2.jsonl`, the same with `--arms silo_imitate`",
        ("2026-12-02-smollm2", "Does sharing pay on SmolLM2"),
    ),
    Claim(
        "sharing-round-cost",
        "A swarm round costs at most 0.8x a round alone, in compute units",
        "the gate, `swarm.own_replay: 4` on both sides",
        "a node alone's round, side by side",
        (Source("sharing_round_cost_replay.jsonl", {"overrides": ["swarm.own_replay=4"]}),),
        newest(lambda r: r["round_cost_ratio_vs_silo"]["sapo_balance_gated"]["units"], "x"),
        AtMost(0.8),
        "`benchmarks/sharing.py --round-cost 30 --round-cost-warmup 5 --arms silo_imitate sapo_balance_gated --set "
        f"swarm.own_replay=4 --seeds 0 {WARM} --baseline silo_imitate --round-cost-results "
        "benchmarks/results/sharing_round_cost_replay.jsonl`",
        ("2026-11-28-sharing-compute-units", "A node alone replays too"),
    ),
)

THEN = "the sharing without it (`sapo_balance`, shipped then)"
ROWS_LAYOUT = "200 units, a row per completion"
SIX_TWO = "sapo_balance[local_questions=6,external_questions=2,generated_questions=6]"  # sapo_balance_6_2, retired
SPLIT = "sapo_balance_{}[share_prompt_forward=false,share_prompt_prefill=false]"  # seeds 1-2 ran in the same layout
section(
    "Mechanisms that did not ship (each against the arm it would have changed)",
    Claim(
        "chord",
        f"CHORD's per-token weight p(1-p), with a decaying coefficient, adds to the sharing ({ROWS_LAYOUT})",
        removed("`trainer.imitation_token_weight`, `trainer.imitation_coef_final`"),
        THEN,
        (Source("sharing.jsonl"),),
        sharing_gain("sapo_balance_chord", "sapo_balance", 200),
        Gain(2.0),
        f"`benchmarks/sharing.py --arms sapo_balance_chord --seeds 0 --budget 200 --points 5 {WARM}`",
        ("2026-11-28-sharing-compute-units", "Specialists at 200 compute units per node"),
    ),
    Claim(
        "pcgrad",
        f"PCGrad between the specialties' gradients adds to the sharing ({ROWS_LAYOUT})",
        removed("`trainer.specialty_weighting: projected`"),
        THEN,
        (Source("sharing.jsonl"),),
        sharing_gain(("sapo_balance_projected", SPLIT.format("projected")), "sapo_balance", 200),
        Gain(2.0),
        f"`benchmarks/sharing.py --arms sapo_balance_projected --seeds S --budget 200 --points 5 {WARM}`",
        ("2026-11-28-sharing-compute-units", "Weighing specialties in the update"),
    ),
    Claim(
        "equal-shares",
        f"Equal shares of the step per specialty add to the sharing ({ROWS_LAYOUT})",
        removed("`trainer.specialty_weighting: equal`"),
        THEN,
        (Source("sharing.jsonl"),),
        sharing_gain(("sapo_balance_equal", SPLIT.format("equal")), "sapo_balance", 200),
        Gain(2.0),
        f"`benchmarks/sharing.py --arms sapo_balance_equal --seeds S --budget 200 --points 5 {WARM}`",
        ("2026-11-28-sharing-compute-units", "Weighing specialties in the update"),
    ),
    Claim(
        "separate-steps",
        "Each specialty its own AdamW step adds to the sharing (100 units)",
        removed("`trainer.specialty_weighting: separate_steps`"),
        THEN,
        (Source("sharing_separate.jsonl"), Source("sharing_long.jsonl")),
        sharing_gain("sapo_balance_separate", "sapo_balance", 100),
        Gain(2.0),
        sharing_command("--arms sapo_balance_separate --seeds S --budget 100 --points 5", "sharing_separate.jsonl"),
        ("2026-11-28-sharing-compute-units", "Each specialty its own AdamW"),
    ),
    Claim(
        "kl-anchor",
        "A KL anchor on the own specialty's questions keeps a node's own specialty (100 units)",
        removed("`trainer.kl_labels`") + " with `trainer.kl_beta: 1.0` (kept: GRPO's KL penalty)",
        THEN + ", on the own specialty",
        (Source("sharing_anchor.jsonl"), Source("sharing_separate.jsonl"), Source("sharing_long.jsonl")),
        sharing_gain("sapo_balance_anchor", "sapo_balance", 100, "own"),
        Gain(2.0),
        sharing_command(
            "--setting specialists --arms sapo_balance_anchor --seeds S --budget 100 --points 5", "sharing_anchor.jsonl"
        ),
        ("2026-11-28-sharing-compute-units", "The own-specialty KL anchor"),
    ),
    Claim(
        "sharing-ramp",
        "Joining gradually (peers' groups ramped in over 200 rounds) keeps a node's own specialty (100 units)",
        removed("`swarm.sharing_ramp_rounds: 200`"),
        THEN + ", on the own specialty",
        (Source("sharing_ramp.jsonl"), Source("sharing_rebuilt.jsonl"), Source("sharing_600.jsonl")),
        sharing_gain("sapo_balance_ramp", "sapo_balance", 100, "own"),
        Gain(2.0),
        sharing_command(
            "--setting specialists --arms sapo_balance_ramp --seeds S --budget 100 --points 5", "sharing_ramp.jsonl"
        ),
        ("2026-11-28-sharing-compute-units", "Joining gradually"),
    ),
    Claim(
        "sharing-6-2",
        "Sharing less (6 own questions and 2 of peers' groups a round) adds on both specialties (100 units)",
        "`swarm.local_questions: 6`, `swarm.external_questions: 2`",
        "the 4/4 sharing (`sapo_balance`, shipped then)",
        (
            Source("sharing_6_2.jsonl"),
            Source("sharing_anchor.jsonl"),
            Source("sharing_separate.jsonl"),
            Source("sharing_long.jsonl"),
        ),
        sharing_gain(("sapo_balance_6_2", SIX_TWO), "sapo_balance", 100),
        Gain(2.0),
        sharing_command(
            "--setting specialists --arms sapo_balance --set swarm.local_questions=6 --set swarm.external_questions=2 "
            "--set swarm.generated_questions=6 --seeds S --budget 100 --points 5",
            "sharing_6_2.jsonl",
        )
        + " (stored as the retired arm sapo_balance_6_2)",
        ("2026-11-28-sharing-compute-units", "Sharing less"),
    ),
    Claim(
        "replay-8-two-specialists",
        "8 replays a round between two specialists add on both operations (300 units)",
        "`swarm.own_replay: 8` (shipped for four specialists only)",
        "the same swarm replaying 4",
        (Source("sharing_replay8_specialists_300.jsonl"), Source("sharing_replay_specialists.jsonl")),
        sharing_gain("sapo_balance_gated[own_replay=8]", SHIPPED_TWO, 300),
        Gain(2.0),
        sharing_command(
            "--setting specialists --arms sapo_balance_gated --set swarm.own_replay=8 --seeds S --budget 300 "
            "--points 6",
            "sharing_replay8_specialists_300.jsonl",
        ),
        ("2026-11-28-sharing-compute-units", "Eight replays between four specialists"),
    ),
    Claim(
        "capability-corrections",
        "HACPO's capability corrections add to SAPO's sharing (both specialties, 60 CPU seconds a node)",
        removed("`swarm.capability_aware: true`"),
        "SAPO 4/4 without them (arm `sapo`)",
        (Source("sharing.jsonl"),),
        sharing_gain("sapo_cap", "sapo", 60.0, axis="cpu"),
        Gain(2.0),
        "`benchmarks/sharing.py --arms silo sapo sapo_cap sapo_cap_unweighted --seeds S --budget 60 --points 3 "
        f"{WARM}`",
        ("2026-11-26-sharing-cpu-seconds", "Specialists at equal node compute, 60 CPU seconds"),
    ),
    Claim(
        "distillation",
        f"A stronger peer's live policy as an on-policy teacher (reverse KL) adds to a node alone ({ROWS_LAYOUT})",
        removed("`trainer.distill_coef: 1`, node/teachers.py"),
        "a node alone (`silo_imitate`)",
        (Source("sharing.jsonl"),),
        sharing_gain("silo_distill", "silo_imitate", 200),
        Gain(2.0),
        f"`benchmarks/sharing.py --arms silo_distill --seeds 0 --budget 200 --points 5 {WARM}`",
        ("2026-11-28-sharing-compute-units", "What costs a node its own specialty"),
    ),
    Claim(
        "positive-only",
        "Only a peer's answers above its group's mean in the policy term (LUFFY's successes-only guidance) adds to the "
        "sharing (100 units)",
        removed("`trainer.off_policy_negatives: false`"),
        THEN,
        (Source("sharing_shared_prompts.jsonl"),),
        sharing_gain("sapo_balance_positive", "sapo_balance", 100),
        Gain(2.0),
        sharing_command(
            "--arms sapo_balance_positive --seeds 0 --budget 100 --points 5", "sharing_shared_prompts.jsonl"
        ),
        ("2026-11-28-sharing-compute-units", "A cost per call in the units, and the arms again in the shipped layout"),
    ),
    Claim(
        "demonstrations-only",
        "Peers' groups as demonstrations only, the policy step a node alone's on its 8 own questions, add to a node "
        "alone (100 units)",
        removed("`swarm.external_use: demonstrations_only`"),
        "a node alone (`silo_imitate`)",
        (Source("sharing_shared_prompts.jsonl"),),
        sharing_gain("silo_imitate_peers", "silo_imitate", 100),
        Gain(2.0),
        sharing_command("--arms silo_imitate_peers --seeds 0 --budget 100 --points 5", "sharing_shared_prompts.jsonl"),
        ("2026-11-28-sharing-compute-units", "A cost per call in the units, and the arms again in the shipped layout"),
    ),
    Claim(
        "peer-imitation-scale",
        f"Weighing a stronger peer's demonstrations half as much as the node's own answers adds to the sharing "
        f"({ROWS_LAYOUT})",
        removed("`swarm.peer_imitation_scale: 0.5`"),
        THEN,
        (Source("sharing.jsonl"),),
        sharing_gain("sapo_balance[peer_imitation_scale=0.5]", "sapo_balance", 200),
        Gain(2.0),
        f"`benchmarks/sharing.py --arms sapo_balance --set swarm.peer_imitation_scale=0.5 --seeds 0 --budget 200 "
        f"--points 5 {WARM}` (0.25: the notebook page)",
        ("2026-11-28-sharing-compute-units", "What costs a node its own specialty"),
    ),
    Claim(
        "gate-equal-nodes",
        "Taking peers' groups only from a stronger peer lets sharing add between equal nodes (held-out ratio, 200 "
        "units)",
        "`swarm.external_gate: stronger_peer` (shipped: it keeps equal nodes level by sharing almost nothing)",
        "a node alone (`silo_imitate`)",
        (Source("sharing_homogeneous_gated.jsonl"), Source("sharing_homogeneous_200.jsonl")),
        homogeneous_ratio("sapo_balance_gated", "silo_imitate", 200),
        Gain(0.02, level=1.0),
        sharing_command(
            "--setting homogeneous --arms sapo_balance_gated --seeds S --budget 200 --points 4",
            "sharing_homogeneous_gated.jsonl",
        ),
        (
            "2026-11-28-sharing-compute-units",
            "Peers' groups only from a stronger peer: `swarm.external_gate` between eq",
        ),
    ),
)

NOLOCO = (Source("sharing_noloco.jsonl"), Source("sharing_rebuilt.jsonl"), Source("sharing_600.jsonl"))
NOLOCO_COMMAND = sharing_command(
    "--setting specialists --arms sapo_balance_noloco silo_imitate_noloco --seeds S --budget 100 --points 5",
    "sharing_noloco.jsonl",
)
section(
    "Weight averaging (NoLoCo)",
    Claim(
        "noloco-specialists-100",
        "NoLoCo (a random partner every 50 updates) adds to the sharing between specialists, at 100 units",
        "`averaging.method: noloco` (no config ships it)",
        "the sharing without averaging (`sapo_balance`)",
        NOLOCO,
        sharing_gain("sapo_balance_noloco", "sapo_balance", 100),
        Gain(2.0),
        NOLOCO_COMMAND,
        ("2026-11-28-sharing-compute-units", "NoLoCo between specialists (issue #33"),
    ),
    Claim(
        "noloco-specialists-600",
        "... and at 600 units",
        "`averaging.method: noloco`",
        "the same",
        (Source("sharing_600_noloco.jsonl"), Source("sharing_600.jsonl")),
        sharing_gain("sapo_balance_noloco", "sapo_balance", 600),
        Gain(2.0),
        sharing_command(
            "--setting specialists --arms sapo_balance_noloco --seeds 0 --budget 600 --points 6",
            "sharing_600_noloco.jsonl",
        ),
        ("2026-11-28-sharing-compute-units", "NoLoCo between specialists, to 600 units"),
    ),
    Claim(
        "noloco-alone",
        "NoLoCo alone, no rollout sharing, adds to nodes that train alone (specialists, 100 units)",
        "`averaging.method: noloco`",
        "the same nodes without averaging (`silo_imitate`)",
        NOLOCO,
        sharing_gain("silo_imitate_noloco", "silo_imitate", 100),
        Gain(2.0),
        NOLOCO_COMMAND,
        ("2026-11-28-sharing-compute-units", "NoLoCo between specialists (issue #33"),
    ),
    Claim(
        "noloco-smollm2-transfer",
        "NoLoCo's exchange of SmolLM2-sized weights (134.5M floats) at 100 Mbit/s ends within the default "
        "`averaging.timeout_s` of 20 s, in every transfer mode",
        "`averaging.timeout_s: 20`",
        "the timeout",
        (Source("noloco_smollm2.jsonl", {"floats": 134515008}),),
        newest_sync_by_mode,
        AtMost(20.0),
        "`benchmarks/averaging_sync.py --lab --sizes 2 --methods noloco --floats 134515008 --mode M --mbit 100 "
        "--rounds 2`",
        ("2026-12-02-smollm2", "NoLoCo between two SmolLM2-sized peers"),
    ),
    Claim(
        "partner-check-cost",
        "The partner check costs less CPU than the one it replaced (float64 copies), on SmolLM2's 272 tensors",
        "node/weights/validation.py",
        "the replaced check, same tensors, same run",
        (Source("exchange_cpu.jsonl"),),
        newest(lambda r: r["check_speedup"], "x"),
        AtLeast(1.0, strict=True),
        "`benchmarks/exchange_cpu.py --results benchmarks/results/exchange_cpu.jsonl`",
        ("2026-12-02-smollm2", "NoLoCo between two SmolLM2-sized peers"),
    ),
)

FAIR = Source("stage_recovery.jsonl", fair_checkfree)


def recovery_claims(rate: float) -> tuple[Claim, Claim]:
    percent = f"{rate:.0%}"
    page = ("2026-12-01-stage-recovery", f"CheckFree+ swapping the first two stages only: {percent[:-1]} %")
    return (
        Claim(
            f"checkfree-vs-checkpoint-{percent[:-1]}",
            f"At {percent[:-1]} % failures per stage per hour CheckFree reaches the target loss at least 1.6x sooner "
            "than checkpoint-restart (#37; the paper: over 12 % at 5-10 %); 27M parameters, English text (the figure: "
            "checkpoint-restart's wall clock to the target over CheckFree's)",
            "CheckFree+ swapping the first pair (`pipeline.checkfree_plus_swap_last: false`)",
            "checkpoint-restart without CheckFree+'s swaps, its checkpoints over each host's 20 Mbit/s uplink",
            (FAIR,),
            recovery_ratio(rate, "checkpoint"),
            AtLeast(1.6, of="mean"),
            f"`benchmarks/stage_recovery.py --plain-baselines --set pipeline.checkfree_plus_swap_last=false --rates "
            f"{rate:.2f} --only-seeds S` with the campaign's other settings (the notebook page), then `--report`",
            page,
        ),
        Claim(
            f"checkfree-vs-random-{percent[:-1]}",
            f"... and sooner than random re-initialisation of the lost stage, at {percent[:-1]} % (random's wall clock "
            "over CheckFree's)",
            "the same",
            "random re-initialisation without the swaps",
            (FAIR,),
            recovery_ratio(rate, "random"),
            Gain(0.05, level=1.0),
            "the row above",
            page,
        ),
    )


section(
    "Pipeline stages (CheckFree)",
    *recovery_claims(0.05),
    *recovery_claims(0.10),
    *recovery_claims(0.16),
    Claim(
        "checkfree-plus-swaps",
        "CheckFree+'s swapped stage order trains as well as no swaps (27M, validation loss after 60 steps from the "
        "same weights; the figure: without the swaps less with them)",
        "`pipeline.checkfree_plus: true` (the default)",
        "the same pipeline without CheckFree+",
        (Source("pipeline_loss_check_27m_swap_every.out"),),
        swap_cost,
        Gain(0.02),
        "`benchmarks/pipeline_throughput.py --sizes 27M --loss-check 60` with the campaign's settings (the notebook "
        "page)",
        ("2026-11-30-pipeline-throughput", "How often to swap"),
    ),
    Claim(
        "checkfree-smollm2",
        "On a pretrained model (SmolLM2, 4 stages) CheckFree rebuilds a lost stage better than random "
        "re-initialisation (the figure: random's training loss less CheckFree's at the last step)",
        "`pipeline.checkfree_plus: false` for a pretrained model",
        "random re-initialisation of the stage",
        (Source("pipeline_pretrained.jsonl", four_stages),),
        pretrained_loss_gap,
        Gain(0.0),
        "`benchmarks/pipeline_pretrained.py --stages 4 --recovery checkfree random --steps 14 --fail-at 6 --set "
        "pipeline.checkfree_plus=false`",
        ("2026-12-02-smollm2", "As pipeline stages"),
    ),
    Claim(
        "checkfree-vs-checkpoint-smollm2",
        "On a pretrained model (SmolLM2, 4 stages, a middle stage lost at step 6) CheckFree is no worse than "
        "checkpoint-restart (the figure: CheckFree's validation loss less checkpoint-restart's at the failure-free "
        "run's last step)",
        "`pipeline.checkfree_plus: false` for a pretrained model",
        "checkpoint-restart every Young's interval (the fair baseline)",
        (Source("stage_recovery_smollm2.jsonl"),),
        pretrained_vs_checkpoint,
        AtMost(0.0),
        "`benchmarks/stage_recovery.py --model smollm2-135m-instruct --lr 3e-5 --micro-batch 4 --max-steps 12 "
        "--eval-every 4 --failures 6:1 --rates 0.10 --seeds 3 --only-seeds N --plain-baselines --side-by-side "
        "--run-timeout-s 1800 --set pipeline.checkfree_plus=false --results "
        "benchmarks/results/stage_recovery_smollm2.jsonl` (one seed a command)",
        ("2026-12-02-smollm2", "As pipeline stages, against checkpoint-restart"),
    ),
    Claim(
        "checkfree-plus-smollm2",
        "With CheckFree+ (the default) a 2-stage SmolLM2 pipeline trains on after losing its end stage (the figure: "
        "the loss before the failure less at the last step)",
        "`pipeline.checkfree_plus: true` (the default)",
        "its own loss before the failure",
        (Source("pipeline_pretrained.jsonl", two_stages),),
        pretrained_two_stages,
        Gain(0.0),
        "`benchmarks/pipeline_pretrained.py --stages 2 --recovery checkfree --steps 14 --fail-at 6`",
        ("2026-12-02-smollm2", "As pipeline stages"),
    ),
    Claim(
        "pipeline-four-hosts",
        "A 27M pipeline across four hosts on 100 Mbit/s links trains at the rate of one process",
        "`pipeline.direct_hops`, `pipeline.wire_dtype: bfloat16`, `pipeline.micro_batches_in_flight: 2` (options)",
        "one process, same run",
        (Source("pipeline_lab_27m_direct_2026-11-29.out"),),
        lab_vs_one_process("bf16+inflight2+direct", 100.0),
        AtLeast(1.0),
        "`benchmarks/pipeline_throughput.py --sizes 27M --stages 4 --steps 2 --lab 100 20` with the variants of the "
        "notebook page",
        ("2026-11-30-pipeline-throughput", "Direct hops"),
    ),
)

section(
    "The swarm, the wire and the hardware",
    Claim(
        "mixed-pair",
        "A mixed pair (SmolLM2 and the default model) across two hosts trains on each other's text: each node trains "
        "on at least one of the other's questions",
        "`configs/smollm2_swarm.yaml` beside `join` on the default model",
        "-",
        (Source("mixed_pair.jsonl"),),
        mixed_pair,
        AtLeast(1.0),
        "`benchmarks/mixed_pair.py --minutes 15`",
        ("2026-12-02-smollm2", "In a swarm"),
    ),
    Claim(
        "crowd",
        "A node's median round next to 1,024 peers is within 1.2x of its round next to 4",
        "`swarm.max_batches_read_per_round`, the sharded rollout keys",
        "the same node next to 4 peers",
        (Source("crowd_2026-11-25.out"), Source("crowd_2026-11-25_run2.out")),
        crowd_round_ratio,
        AtMost(1.2),
        "`PYTHONPATH=. .venv/bin/python benchmarks/crowd.py --sizes 4 64 256 1024 --measure_s 30`",
        ("2026-11-25-crowd", "crowd"),
    ),
    Claim(
        "gpu-rounds",
        "A node on a GPU runs more rounds a second than on its machine's CPU (33.6M parameters, an H200)",
        "`model.device: auto`",
        "the same node on that machine's 16-core CPU, same run",
        (Source("gpu_round_h200.jsonl", lines=(3, 3)),),
        gpu_rounds,
        AtLeast(1.0, strict=True),
        "`benchmarks/gpu_round.py --device cuda --device cuda@bfloat16 --device cpu --budget-s 200`",
        ("2026-11-27-gpu", "bfloat16 on a GPU"),
    ),
    Claim(
        "gpu-bfloat16",
        "bfloat16 makes a GPU node faster than float32 (33.6M and 268.6M parameters, after the cuDNN fix)",
        "`model.dtype: bfloat16` (an option)",
        "float32 on the same GPU, same run",
        (Source("gpu_round_h200.jsonl", lines=(3, 5)),),
        gpu_bfloat16,
        Gain(0.05, level=1.0),
        "`benchmarks/gpu_round.py --device cuda --device cuda@bfloat16` with the sizes of the notebook page",
        ("2026-11-27-gpu", "bfloat16 on a GPU"),
    ),
    Claim(
        "freed-memory",
        "A training node's resident memory at the end of a run is within +10 % of its value after the warm-up",
        "`hand_back_freed_memory` (node/host_memory.py: blocks past 256 KiB mapped apart and handed back)",
        "glibc's defaults, and `malloc_trim(0)` after every round, side by side in the same run",
        (Source("freed_memory.jsonl"),),
        newest(
            lambda r: max(f["ratio"] for f in r["arms"]["hand_back"]),
            "x",
            per="run, the larger of its repeats",
            note=lambda r: (
                "glibc's defaults x"
                + "/x".join(f"{f['ratio']:.2f}" for f in r["arms"]["defaults"])
                + "; trim after every round x"
                + "/x".join(f"{f['ratio']:.2f}" for f in r["arms"]["trim"])
                + f" at {min(f['rss_end_mib'] for f in r['arms']['trim']):.0f}-"
                + f"{max(f['rss_end_mib'] for f in r['arms']['trim']):.0f} MiB against "
                + f"{min(f['rss_end_mib'] for f in r['arms']['hand_back']):.0f}-"
                + f"{max(f['rss_end_mib'] for f in r['arms']['hand_back']):.0f} MiB"
            ),
        ),
        AtMost(1.10),
        "`benchmarks/freed_memory.py --rounds 300 --warmup 30 --peers 8 --repeats 2 --results "
        "benchmarks/results/freed_memory.jsonl`",
        ("2026-12-02-unattended", "Handing freed memory back"),
    ),
)

SOAK = (Source("soak.jsonl"),)
SOAK_COMMAND = (
    "`sudo .venv/bin/python -m benchmarks.soak --cycles 2 --gap-s 10 --fault-s 60 --results "
    "benchmarks/results/soak.jsonl` (each fault kind twice, accelerated; the seven-cycle run before it is in the "
    "notebook)"
)
SOAK_NOTEBOOK = ("2026-12-04-soak", "Two cycles on 9ac09d7 (the results page's soak rows)")
SOAK_TOPOLOGY = "8 join nodes (two behind NAT), a 3-stage pipeline with a spare and its driver, each in its namespace"


def restart_breakdown(row: dict) -> str:
    """Where the restarted processes' time went (median, max over the restarts), where the soak measured it."""
    breakdown = row.get("restart_breakdown_s")
    if not breakdown:
        return ""
    moments = {
        "resumed": "policy resumed",
        "joined": "listening",
        "first_round": "first round",
        "exchanged": "exchanged",
    }
    said = ", ".join(
        f"{label} {breakdown[key]['median']} ({breakdown[key]['max']})"
        for key, label in moments.items()
        if breakdown[key]
    )
    return f"; a restart, seconds from its start, median (max): {said}"


def soak_lost(row: dict) -> float:
    """What the soak found lost or broken: crashes, metrics not contiguous, policy versions gone back, kept
    checkpoints that do not load, processes not alive at the end or printing a traceback when stopped."""
    return (
        row["crashes"]
        + sum(reason is not None for reason in row["rows_contiguous"].values())
        + sum(reason is not None for reason in row["versions_forward"].values())
        + sum(len(damaged) for damaged in row["unloadable_checkpoints"].values())
        + (not row["alive_at_end"])
        + len(row["tracebacks_on_stop"])
    )


section(
    "A node that runs unattended (the soak)",
    Claim(
        "soak",
        f"In the soak ({SOAK_TOPOLOGY}) nothing is lost: no crash, metrics contiguous across every restart, policy "
        "versions only forward, every kept checkpoint loadable, every process alive and stopping cleanly on Ctrl-C "
        "(the figure: how many of these failed)",
        "the node as it ships (its supervision, state directory and stops)",
        "-",
        SOAK,
        newest(
            soak_lost,
            "failures",
            note=lambda r: (
                f"{r['hours']:.2f} h at load {r['load_average'][0]:.0f}, exit codes at the stop "
                f"{sorted(set(r['exit_codes_on_stop'].values()))} (130: stopped while starting)"
            ),
        ),
        AtMost(0),
        SOAK_COMMAND,
        SOAK_NOTEBOOK,
    ),
    Claim(
        "soak-recovery",
        "Every injected fault is recovered from within 60 s: lifted to the hit processes' next exchange with a peer "
        "(the figure: the slowest kind)",
        "the node as it ships",
        "-",
        SOAK,
        newest(
            lambda r: max(float("inf") if v is None else v for v in r["recovery_s_by_kind"].values()),
            "s",
            note=lambda r: (
                ", ".join(
                    f"{k} {'not recovered in the timeout' if v is None else v}"
                    for k, v in r["recovery_s_by_kind"].items()
                )
                + restart_breakdown(r)
            ),
        ),
        AtMost(60),
        SOAK_COMMAND,
        SOAK_NOTEBOOK,
    ),
    Claim(
        "soak-stall",
        "No training stall longer than 2 minutes on any node or the driver (the longest gap between two metrics rows "
        "outside a process's scheduled downtime)",
        "the node as it ships",
        "-",
        SOAK,
        newest(lambda r: r["max_stall_s_overall"], "s"),
        AtMost(120),
        SOAK_COMMAND,
        SOAK_NOTEBOOK,
    ),
    Claim(
        "soak-readyz",
        "/readyz says not ready within 30 s of a node's p2p daemon dying, and ready again once it rejoined",
        "`swarm.metrics_port` (the node's HTTP endpoint)",
        "-",
        SOAK,
        newest(
            lambda r: max(e["not_ready_after_s"] for e in r["readyz"]),
            "s",
            note=lambda r: "ready again after " + ", ".join(f"{e['ready_again_after_s']} s" for e in r["readyz"]),
        ),
        AtMost(30),
        SOAK_COMMAND,
        SOAK_NOTEBOOK,
    ),
    Claim(
        "soak-clock",
        "A node whose clock jumps 5 minutes ahead says so, with the figure, within 60 s (the figure: the slowest of "
        "the jumps)",
        "the node as it ships (its clock offset, node/stats.py)",
        "-",
        SOAK,
        newest(
            lambda r: max(
                float("inf") if e["details"].get("said_after_s") is None else e["details"]["said_after_s"]
                for e in r["events"]
                if e["kind"] == "clock_jump"
            ),
            "s",
            note=lambda r: (
                "said ahead by "
                + ", ".join(f"{e['details'].get('said_ahead_s')} s" for e in r["events"] if e["kind"] == "clock_jump")
            ),
        ),
        AtMost(60),
        SOAK_COMMAND,
        SOAK_NOTEBOOK,
    ),
    Claim(
        "soak-rss",
        "RSS at the soak's end within +10 % of its value 10 minutes after each process's (last) start, on every "
        "process that lived that long",
        "the node as it ships",
        "-",
        SOAK,
        newest(
            lambda r: r["rss_max_ratio"],
            "x",
            note=lambda r: (
                f"{sum(g is not None for g in r['rss'].values())} of {len(r['rss'])} processes lived "
                "10 minutes past their last start"
            ),
        ),
        AtMost(1.10),
        SOAK_COMMAND,
        SOAK_NOTEBOOK,
    ),
)

NOT_GENERATED = [
    (
        "swarm_propagation (publish to received, join time, bytes a round)",
        "its JSON lines are only in the notebook; a rerun with its output kept in results/ would give it a row",
        ("2026-11-23-swarm-propagation", "swarm_propagation"),
    ),
    (
        "averaging_sync and averaging_learning on the default model (NoLoCo against DiLoCo)",
        "their JSON lines are only in the notebook",
        ("2026-11-25-averaging-learning", "averaging_learning"),
    ),
    (
        "isolated_learning in 10 minutes (before the imitation term)",
        "its JSON line is only in the notebook; the first row above is today's default at equal compute",
        ("2026-11-22-isolated-learning", "isolated_learning"),
    ),
    (
        "a node on an H100 against its CPU",
        "its JSON line was not kept (the H200 rows above replace it)",
        ("2026-11-27-gpu", "GPU"),
    ),
    (
        "HACPO's sequence-level importance weight (`trainer.importance_level: sequence`)",
        f"never run: no stored result (removed; code at {REMOVED_AT})",
        ("2026-11-26-sharing-cpu-seconds", "Specialists at equal node compute, 60 CPU seconds"),
    ),
    (
        "two SmolLM2 nodes across two hosts",
        "tool output without a JSON line (`results/two_hosts_smollm2_2026-12-01.out`)",
        ("2026-12-02-smollm2", "In a swarm"),
    ),
    (
        "the lab's swarm cost, suite_under_load, the container image, docker-compose, NAT, relays, fuzz at scale",
        "tests and tool runs without a results file",
        ("2026-11-23-lab", "lab"),
    ),
]


# the page ------------------------------------------------------------------------------------------------------------


def anchor_of(page: str, heading_start: str, notebook: Path = NOTEBOOK) -> str:
    """The GitHub anchor of the first heading of a notebook page that starts with `heading_start` (after the #s)."""
    path = notebook / f"{page}.md"
    if not path.exists():
        raise ResultsError(f"notebook page {page}.md does not exist")
    seen: dict[str, int] = {}
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            continue
        title = line.lstrip("#").strip()
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        if title.startswith(heading_start):
            return slug if count == 0 else f"{slug}-{count}"
    raise ResultsError(f"notebook page {page}.md has no heading starting {heading_start!r}")


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def notebook_link(page: str, heading: str, notebook: Path) -> str:
    return f"[{page}](notebook/{page}.md#{anchor_of(page, heading, notebook)})"


def rule_text(rule: Rule) -> str:
    if isinstance(rule, Gain):
        return f"gain, tolerance {rule.tolerance:g}"
    if isinstance(rule, Both):
        return f"{rule_text(rule.first)} and {rule_text(rule.second)}"
    sign = ">" if isinstance(rule, AtLeast) and rule.strict else ">=" if isinstance(rule, AtLeast) else "<="
    return f"{rule.of} {sign} {rule.target:g}"


def row(claim: Claim, results: Path, notebook: Path) -> str:
    figure, verdict = claim.read(results)
    files = ", ".join(dict.fromkeys(f"[{s.file}](results/{s.file})" for s in claim.sources))
    cells = [
        f'<a id="{claim.anchor}"></a>{claim.claim}',
        claim.setting,
        claim.baseline,
        figure.text(),
        f"**{verdict}** ({rule_text(claim.rule)})",
        claim.command,
        files,
        notebook_link(*claim.notebook, notebook),
    ]
    return "| " + " | ".join(cell(c) for c in cells) + " |"


HEADER = (
    "| claim (target) | shipped setting | fair baseline | figure | verdict (rule) | command | results | notebook |\n"
    "|---|---|---|---|---|---|---|---|"
)

INTRO = """# Results

One row per claim: what is claimed and its target, the setting that ships, the baseline it is measured against (the
fair one), the figure with its spread over seeds, the verdict, the command that measured it, the raw results and the
notebook page that tells the campaign. It is generated from `benchmarks/results/`:
`.venv/bin/python benchmarks/results_page.py` writes it, and with `--check` fails where it and the results disagree
(tests/test_results_page.py runs the check), so do not edit it by hand. The lab notebook, every campaign as written
at the time, is [notebook/](notebook/README.md).

Sharing budgets are in compute units: a unit is one idle-machine CPU second of a round's work (token positions through
the sampler and the update, completions scored, optimizer steps, each kind weighed by its measured cost:
`benchmarks/compute_units.py`, `node/compute.py`), so two nodes given the same units did the same work whatever the
machine's load. Held-out accuracy is greedy exact match on 200 fixed questions per specialty; "points" are 100 x its
difference. Commands run from the repository root with `.venv/bin/python`.

Verdicts: a target (`every >= x`, `mean >= x`, `<= x`) is **met** or **not met**. A mechanism against its baseline
(`gain`, the difference, or for a ratio its distance from 1): **met** where every value is above the tolerance,
**loses** where the mean is under minus the tolerance, **no better** where the mean is within it, **mixed** where the
mean is above it and not every value is."""


def render(results: Path = RESULTS, notebook: Path = NOTEBOOK) -> str:
    parts = [INTRO]
    for title, claims in SECTIONS:
        parts.append(f"## {title}\n\n{HEADER}\n" + "\n".join(row(c, results, notebook) for c in claims))
    listed = "\n".join(
        f"- {what}: {why} ({notebook_link(page, heading, notebook)})" for what, why, (page, heading) in NOT_GENERATED
    )
    parts.append(f"## Not generated\n\nFigures the notebook gives that no file here holds:\n\n{listed}")
    return "\n\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 with a diff if the page is not what it generates")
    args = parser.parse_args(argv)
    page = render()
    if not args.check:
        PAGE.write_text(page)
        print(f"wrote {PAGE.relative_to(BENCHMARKS.parent)} ({page.count(chr(10))} lines)")
        return 0
    committed = PAGE.read_text() if PAGE.exists() else ""
    if committed == page:
        return 0
    diff = difflib.unified_diff(
        committed.splitlines(keepends=True), page.splitlines(keepends=True), "benchmarks/README.md", "generated"
    )
    sys.stdout.writelines(diff)
    print(f"\nbenchmarks/README.md differs from the results: run {GENERATOR}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
