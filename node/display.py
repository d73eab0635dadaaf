"""What a person watching a node sees: a live panel on a terminal, one line per round otherwise."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table


def _eta(seconds: float | None) -> str:
    if seconds is None:
        return "until Ctrl-C"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


def overlap_cells(row: dict[str, Any]) -> list[tuple[str, str]]:
    """(header, value) of what a round that overlaps generation with training reports (rollout.max_staleness,
    rollout.over_sample): the policy versions its completions were behind (mean/max), the completions it resumed and
    stopped, the seconds it waited for the rollouts generated ahead and the seconds the sampler waited for it. None of
    them in a round with both off."""
    cells = []
    if row.get("staleness_mean") is not None:
        cells.append(("stale", f"{row['staleness_mean']:.1f}/{row['staleness_max']}"))
    if row.get("carried_in") is not None:
        cells.append(("carried", f"{row['carried_in']}/{row['carried_out']}"))
    if row.get("ahead_wait_s") is not None:
        cells.append(("waited", f"{row['ahead_wait_s']:.1f}s"))
    if row.get("sampler_idle_s") is not None:
        cells.append(("idle", f"{row['sampler_idle_s']:.1f}s"))
    return cells


def restart_cells(restarts: dict[str, int]) -> list[tuple[str, str]]:
    """(header, value) of each part the node restarted or reported since it started (swarm connections rejoined,
    rounds stalled): shown once one has happened, so that a node that heals itself says so where it is watched."""
    return [(name, str(count)) for name, count in restarts.items() if count]


def clock_cells(row: dict[str, Any], warn_s: float | None) -> list[tuple[str, str]]:
    """The node's clock against the swarm's, shown once it is off by `warn_s` or more (None: never; the log says what
    that costs)."""
    offset = row.get("clock_offset_s")
    return [("clock", f"{offset:+.0f}s")] if warn_s is not None and offset is not None and abs(offset) >= warn_s else []


class RoundDisplay:
    def __init__(
        self,
        console: Console,
        first_round: int,
        target_round: int | None,
        title: str,
        restarts: Callable[[], dict[str, int]] = dict,
        clock_warn_s: float | None = None,
    ):
        """`restarts` counts what the node rejoined or reported since it started, by name (none: an empty dict);
        a row's clock offset is shown from `clock_warn_s` on (None: never)."""
        self.console = console
        self.restarts = restarts
        self.clock_warn_s = clock_warn_s
        self.first_round = first_round
        self.target_round = target_round
        self.title = title
        self.started = time.monotonic()
        self.last: dict[str, Any] | None = None
        self.last_heldout: float | None = None
        self.live = (
            Live(self._render(), console=console, refresh_per_second=4, transient=False)
            if console.is_terminal
            else None
        )

    def __enter__(self) -> "RoundDisplay":
        if self.live:
            self.live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.live:
            self.live.__exit__(*exc)

    def stop(self) -> None:
        """Leave the terminal as a plain one before the process goes on without the display (a restart)."""
        if self.live:
            self.live.stop()

    def eta_s(self) -> float | None:
        if self.target_round is None or self.last is None:
            return None
        done = self.last["round"] - self.first_round
        per_round = (time.monotonic() - self.started) / max(done, 1)
        return per_round * (self.target_round - self.last["round"])

    def _render(self) -> Table:
        table = Table(title=self.title, show_header=True, header_style="bold")
        row = self.last
        overlap = overlap_cells(row) if row is not None else []
        overlap += restart_cells(self.restarts()) + clock_cells(row, self.clock_warn_s) if row is not None else []
        for column in (
            "round",
            "reward",
            "accuracy",
            "held-out",
            "tokens/s",
            "step",
            "policy",
            *(h for h, _ in overlap),
        ):
            table.add_column(column, justify="right")
        table.add_column("ETA", justify="right")
        if row is None:
            table.add_row("-", "-", "-", "-", "-", "-", "-", "starting")
            return table
        target = f"/{self.target_round}" if self.target_round else ""
        heldout = "-" if self.last_heldout is None else f"{self.last_heldout:.1%}"
        table.add_row(
            f"{row['round']}{target}",
            f"{row['reward_mean']:.3f}",
            f"{row['accuracy']:.1%}",
            heldout,
            f"{row['tokens_per_s']:.0f}",
            f"{row['step_s']:.2f}s",
            str(row["policy_version"]),
            *(value for _, value in overlap),
            _eta(self.eta_s()),
        )
        return table

    def update(self, row: dict[str, Any]) -> None:
        self.last = row
        if "heldout_accuracy" in row:
            self.last_heldout = row["heldout_accuracy"]
        if self.live:
            self.live.update(self._render())
        else:
            heldout = f" heldout={row['heldout_accuracy']:.3f}" if "heldout_accuracy" in row else ""
            cells = overlap_cells(row) + restart_cells(self.restarts()) + clock_cells(row, self.clock_warn_s)
            overlap = "".join(f" {header}={value}" for header, value in cells)
            self.console.print(
                f"round {row['round']} reward={row['reward_mean']:.3f} accuracy={row['accuracy']:.3f}{heldout} "
                f"tokens/s={row['tokens_per_s']:.0f} step={row['step_s']:.2f}s policy={row['policy_version']}{overlap} "
                f"eta={_eta(self.eta_s())}",
                highlight=False,
            )
