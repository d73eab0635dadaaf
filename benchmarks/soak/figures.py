"""What a soak's state directories and samples say: the figures of issue #73's targets, each computed from files the
nodes wrote (metrics.jsonl, swarm.json, their checkpoints) and the soak's own samples (RSS, /readyz), never from the
soak's belief of what should have happened."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path


def read_rows(state_dir: Path) -> list[dict]:
    """The metrics rows of a node (a row per round) or a driver (a row per step); a line cut short by a kill is
    left out, as the node's own reader does."""
    path = state_dir / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def used_by_peer(state_dir: Path) -> dict[str, int]:
    """Peers' questions this node trained on, per peer (swarm.json; {} before the node first wrote it)."""
    try:
        peers = json.loads((state_dir / "swarm.json").read_text())["peers"]
    except (OSError, ValueError, KeyError):
        return {}
    return {peer: counters.get("questions_used", 0) for peer, counters in peers.items()}


def swarm_totals(state_dir: Path) -> dict:
    try:
        return json.loads((state_dir / "swarm.json").read_text())["totals"]
    except (OSError, ValueError, KeyError):
        return {}


@dataclass(frozen=True)
class Downtime:
    """A stretch when the soak itself had a process down (killed, then started again): no row is owed then."""

    index: int
    start: float
    end: float | None = None  # None: still down (or never came back)


def row_gaps(rows: list[dict], downtimes: list[Downtime], key: str = "time") -> list[tuple[float, float]]:
    """(start, seconds) of every stretch between two consecutive rows that no scheduled downtime of the process
    overlaps: the stalls a user would see."""
    times = sorted(r[key] for r in rows if isinstance(r.get(key), (int, float)))
    gaps = []
    for before, after in zip(times, times[1:]):
        if any(d.start < after and (d.end is None or d.end > before) for d in downtimes):
            continue
        gaps.append((before, after - before))
    return gaps


def contiguous(rows: list[dict], key: str = "round") -> str | None:
    """Why the rows' counter (round or step) is not 1, 2, ..., N once each (None: it is)."""
    counters = [r.get(key) for r in rows]
    if not counters:
        return None
    first = counters[0] if key == "step" else 1  # a driver may count steps from where its stages stood
    expected = list(range(first, first + len(counters)))
    if counters == expected:
        return None
    for i, (got, want) in enumerate(zip(counters, expected)):
        if got != want:
            return f"row {i + 1} has {key} {got}, not {want}"
    return f"{len(counters)} rows, expected {len(expected)}"


def versions_forward(rows: list[dict]) -> str | None:
    """Why the rows' policy versions ever go back (None: only forward or equal)."""
    versions = [(r.get("round"), r["policy_version"]) for r in rows if "policy_version" in r]
    for (_, before), (round_, after) in zip(versions, versions[1:]):
        if after < before:
            return f"round {round_}: policy version {after} after {before}"
    return None


def first_after(samples: list[tuple[float, object]], moment: float, holds) -> float | None:
    """The first sample time at or after `moment` whose value holds `holds` (None: none did)."""
    return next((t for t, value in samples if t >= moment and holds(value)), None)


def rss_growth(samples: list[tuple[float, float]], since: float, baseline_after_s: float) -> dict | None:
    """RSS at the first sample `baseline_after_s` after `since` (the process's last start) and at the end, MiB, and
    their ratio; None when the process did not live that long."""
    kept = [(t, mib) for t, mib in samples if t >= since]
    base = next(((t, mib) for t, mib in kept if t >= since + baseline_after_s), None)
    if base is None or not kept or kept[-1][0] <= base[0]:
        return None
    end = kept[-1][1]
    return {"baseline_mib": round(base[1], 1), "end_mib": round(end, 1), "ratio": round(end / base[1], 3)}


def unloadable_checkpoints(state_dir: Path) -> dict[str, str]:
    """The checkpoints kept in a node's state directory that would not load, with why (node/state.py's own check)."""
    from node.state import StateStore  # torch: only where checkpoints are read

    store = StateStore(state_dir)
    return {path.name: why for path in store.kept_checkpoints() if (why := store.damage(path))}


def logged_after(log: Path, needle: str, since: float) -> float | None:
    """Seconds from `since` to the first line of a node.log (its default asctime, local time) at or after `since` that
    holds `needle` (None: none)."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return None
    for line in lines:
        if needle not in line:
            continue
        try:
            stamp, millis = line[:23].split(",")
            at = time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S")) + int(millis) / 1000
        except ValueError:
            continue
        if at >= since:
            return round(at - since, 1)
    return None


def spread(values: list[float | None]) -> dict | None:
    """The median and the max of the values measured (None: none was)."""
    measured = sorted(v for v in values if v is not None)
    if not measured:
        return None
    return {"median": measured[len(measured) // 2], "max": measured[-1], "n": len(measured)}
