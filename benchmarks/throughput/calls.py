"""A pipeline call's accounting: its round trip against its compute, from the driver's and the servers' records."""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict

from node.pipeline.handler import CALL_PHASES

PASS_OF_OP = {"forward": "forward", "collect": "forward", "backward": "backward"}


def summarize_calls(rows: list[dict], micro_batches: int) -> dict:
    """Mean seconds by op, and tensor payload bytes per micro-batch, each way (forward and backward calls): those of
    each micro-batch's last attempt (what the shapes imply), and apart those of attempts whose route broke and were
    sent again (`retried_bytes_per_micro_batch`)."""
    by_op: dict[str, list[float]] = defaultdict(list)
    for row in rows:
        by_op[row["op"]].append(row["s"])
    passes = max(1, micro_batches)
    last_attempt: dict[str, int] = {}
    for row in rows:
        last_attempt[row["micro_batch"]] = max(last_attempt.get(row["micro_batch"], 0), row["attempt"])
    final = [r for r in rows if r["attempt"] == last_attempt[r["micro_batch"]]]
    retried = [r for r in rows if r["attempt"] != last_attempt[r["micro_batch"]]]

    def per_micro_batch(chosen: list[dict]) -> dict[str, float]:
        # a chained forward's output comes back by the driver's `collect` of it (pipeline.direct_hops)
        return {
            f"{op}_{way}": sum(r[way] for r in chosen if PASS_OF_OP.get(r["op"]) == op) / passes
            for op in ("forward", "backward")
            for way in ("out", "in")
        }

    hops = sum(1 for r in final if r["op"] == "forward") / passes
    return {
        "calls_s": {op: statistics.fmean(v) for op, v in by_op.items()},
        "calls": {op: len(v) for op, v in by_op.items()},
        "hops_per_micro_batch": hops,
        "bytes_per_micro_batch": per_micro_batch(final),
        "retried_calls": len(retried),
        "retried_bytes_per_micro_batch": per_micro_batch(retried),
    }


def server_ms_per_call(before: list[dict], after: list[dict]) -> dict[str, dict[str, float]]:
    """Where the servers' time went per forward and backward call between two `Servers.served` snapshots: mean ms
    of each phase of node/pipeline/handler.py's CALL_PHASES over every server's calls of that op, and their sum."""

    def total(op: str, key: str) -> float:  # over every server, between the two snapshots
        return sum(a.get(op, {}).get(key, 0) - b.get(op, {}).get(key, 0) for b, a in zip(before, after))

    out = {}
    for op in ("forward", "backward"):
        calls = total(op, "calls")
        if not calls:
            continue
        phases = {phase: 1000 * total(op, phase) / calls for phase in CALL_PHASES}
        out[op] = {
            **phases,
            "total": sum(phases.values()),
            "calls": calls,
            "compute_cpu": 1000 * total(op, "compute_cpu") / calls,
            "compute_faults": total(op, "compute_faults") / calls,
        }
    return out


def compute_per_call(work: dict[str, Counter]) -> dict[str, dict[str, float]]:
    """The in-process way's torch work per forward and backward call (LocalRouter.work), in server_ms_per_call's
    units: wall ms under the lock, its worker thread's CPU ms and minor page faults."""
    out = {}
    for op in ("forward", "backward"):
        calls = work.get(op, {}).get("calls", 0)
        if calls:
            out[op] = {
                "compute": 1000 * work[op]["compute"] / calls,
                "compute_cpu": 1000 * work[op]["compute_cpu"] / calls,
                "compute_faults": work[op]["compute_faults"] / calls,
            }
    return out


def hop_overhead_ms(wire: list[dict], local: list[dict]) -> dict[str, float]:
    """Per op, the mean round trip over the wire less the mean of the same (op, stage, parts) call in-process."""
    local_mean: dict[tuple, list[float]] = defaultdict(list)
    for row in local:
        local_mean[(row["op"], row["stage"], row["parts"])].append(row["s"])
    diffs: dict[str, list[float]] = defaultdict(list)
    for row in wire:
        same = local_mean.get((row["op"], row["stage"], row["parts"]))
        if same:
            diffs[row["op"]].append(row["s"] - statistics.fmean(same))
    return {op: 1000 * statistics.fmean(v) for op, v in diffs.items()}
