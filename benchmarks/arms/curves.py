"""Reading a run's curves: held-out accuracy at a node's compute, per node and over the nodes, and its spread over
seeds."""

from __future__ import annotations

import statistics

from benchmarks import common
from benchmarks.arms.catalog import NODES, SPECIALTIES


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
    """benchmarks.common's spread of the per-seed values, with the values themselves."""
    return {**common.spread(values), "per_seed": values}
