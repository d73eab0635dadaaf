"""--plot and --plot-four: held-out accuracy against compute, per arm."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path

from benchmarks.arms.catalog import FOUR_SPECIALTIES, NODES
from benchmarks.arms.curves import at_compute, mean_metric


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
