"""The terminal view of what the dashboard shows: `swarm-node peers` prints these tables, from the
same rows (node/dashboard/sources.py) that `/api/peers` and `/api/stages` serve."""

from __future__ import annotations

import time
from typing import Any, Callable

from rich.table import Table


# (header, cell, priority): the table keeps the columns that fit the terminal, dropping the
# highest priority number first; `--json` always has every field.
PEER_COLUMNS: tuple[tuple[str, Callable[[dict[str, Any], float], str], int], ...] = (
    ("node", lambda r, now: r["node_id"][:12], -1),
    ("name", lambda r, now: r["display_name"][:16], 1),
    ("reach", lambda r, now: r.get("reachability") or "-", 2),  # direct / relayed / outbound-only (behind NAT)
    ("device", lambda r, now: short_device(r.get("device") or "-"), 4),  # cpu, or the card (cuda:N NVIDIA ...)
    ("round", lambda r, now: str(r["round"]), 0),
    ("policy", lambda r, now: str(r["policy_version"]), 3),
    ("reward", lambda r, now: f"{r['reward_mean']:.3f}", 0),
    ("accuracy", lambda r, now: f"{r['accuracy']:.1%}", 0),
    ("published", lambda r, now: str(r["rollouts_published"]), 5),
    ("received", lambda r, now: str(r["rollouts_received"]), 4),
    ("accepted", lambda r, now: str(r["rollouts_accepted"]), 2),
    ("rejected", lambda r, now: str(r["rollouts_rejected"]), 2),
    ("averaged", lambda r, now: f"{r['outer_steps']}/{r['outer_steps'] + r['outer_steps_skipped']}", 3),
    ("weakest", lambda r, now: weakest_specialty(r.get("accuracy_by_dataset") or {}), 5),
    ("tokens/s", lambda r, now: f"{r['tokens_per_s']:.0f}", 4),
    ("up", lambda r, now: f"{r['uptime_s'] / 60:.1f}m", 5),
    ("rejoins", lambda r, now: str(r.get("rejoins", 0)), 5),  # swarm connections it rebuilt (a daemon that died)
    ("restarts", lambda r, now: str(r.get("restarts", 0)), 5),  # its process started again (killed, crashed, stalled)
    ("seen", lambda r, now: f"{max(0.0, now - r['last_seen']):.0f}s ago", 1),
)


# Shown only when some peer reports them (protocol 1.10, "idle" 1.11; a node whose generation overlaps its training,
# which is off by default), before "seen": the policy versions its own completions were behind (mean/max), the
# completions it carried into/out of its last round (rollout.over_sample), the seconds it waited for the rollouts
# generated ahead, and the seconds its sampler waited for the round to hand it the next questions.
OVERLAP_COLUMNS: tuple[tuple[str, Callable[[dict[str, Any], float], str], int], ...] = (
    ("stale", lambda r, now: pair(r, "staleness_mean", "staleness_max", "{:.1f}/{}"), 3),
    ("carried", lambda r, now: pair(r, "carried_in", "carried_out", "{}/{}"), 4),
    ("waited", lambda r, now: "-" if r.get("ahead_wait_s") is None else f"{r['ahead_wait_s']:.1f}s", 4),
    ("idle", lambda r, now: "-" if r.get("sampler_idle_s") is None else f"{r['sampler_idle_s']:.1f}s", 4),
)
# the field that says whether a row has the column
OVERLAP_FIELDS = {
    "stale": "staleness_mean",
    "carried": "carried_in",
    "waited": "ahead_wait_s",
    "idle": "sampler_idle_s",
}


def pair(row: dict[str, Any], first: str, second: str, form: str) -> str:
    """Two of a row's fields in `form`, or '-' where the peer does not report them (off, or an older peer)."""
    if row.get(first) is None or row.get(second) is None:
        return "-"
    return form.format(row[first], row[second])


def peer_columns(rows: list[dict[str, Any]]) -> tuple[tuple[str, Callable[[dict[str, Any], float], str], int], ...]:
    """PEER_COLUMNS, with the overlap columns some row has before the last one ("seen")."""
    overlap = tuple(c for c in OVERLAP_COLUMNS if any(r.get(OVERLAP_FIELDS[c[0]]) is not None for r in rows))
    return PEER_COLUMNS[:-1] + overlap + PEER_COLUMNS[-1:]


def short_device(device: str) -> str:
    """'cuda:0 NVIDIA GeForce RTX 4090' as 'RTX 4090', 'cpu' as itself: the card's model, in 12 characters at most
    (`--json` has the whole description)."""
    words = [word for word in device.split()[1:] if word not in ("NVIDIA", "GeForce", "Tesla")] or device.split()
    return " ".join(words[:2])[:12]


def weakest_specialty(by_dataset: dict[str, float]) -> str:
    """The specialty of the node's task mix it answers worst (a peer that solves it is worth sampling), or '-'."""
    if len(by_dataset) < 2:
        return "-"
    label = min(by_dataset, key=by_dataset.get)
    return f"{label[:14]} {by_dataset[label]:.0%}"


def peers_table(rows: list[dict[str, Any]], swarm_id: str, width: int = 200) -> Table:
    """The peers as a table no wider than `width`: columns that do not fit are left out (and named in the caption)."""
    now = time.time()
    columns = peer_columns(rows)
    cells = {header: [cell(row, now) for row in rows] for header, cell, _ in columns}
    column_width = {header: max([len(header), *map(len, cells[header])]) for header in cells}
    shown = [header for header, _, _ in columns]
    table_width = lambda headers: sum(column_width[h] + 3 for h in headers) + 1  # noqa: E731 - padding 1+1 and a border per column
    for header, _, _ in sorted(columns, key=lambda column: -column[2]):
        if table_width(shown) <= width or len(shown) == 1:
            break
        shown.remove(header)
    hidden = [header for header, _, _ in columns if header not in shown]
    table = Table(
        title=f"swarm {swarm_id}: {len(rows)} live peer(s)",
        caption=f"not shown for width: {', '.join(hidden)} (see --json)" if hidden else None,
    )
    for header in shown:
        table.add_column(
            header, justify="left" if header in ("node", "name") else "right", no_wrap=True, min_width=len(header)
        )
    for i in range(len(rows)):
        table.add_row(*(cells[header][i] for header in shown))
    return table


def stage_tables(stage_maps) -> list[Table]:
    """The stage map of each pipeline in the swarm: stage -> servers, throughput, steps, recoveries."""
    tables = []
    for fingerprint, stage_map in stage_maps.items():
        table = Table(
            title=f"pipeline of model {fingerprint}: {stage_map.num_stages} stages, {len(stage_map.spares)} spare(s)"
        )
        for column in ("stage", "layers", "servers", "loading", "samples/s", "step", "grad norm", "recoveries"):
            table.add_column(column, justify="left" if column in ("servers", "loading") else "right")
        for row in stage_map.rows():
            table.add_row(
                str(row["stage"]),
                row["layers"],
                " ".join(n[:8] for n in row["servers"]) or "[red]none[/]",
                " ".join(n[:8] for n in row["loading"]),
                f"{row['samples_per_s']:.1f}",
                str(row["step"]),
                f"{row['grad_norm']:.3f}",
                str(row["recoveries"]),
            )
        tables.append(table)
    return tables
