"""benchmarks/pipeline_throughput.py in its tiny mode: every figure is there, and the bytes are what the shapes imply.

No timing is asserted (the machine is shared); the bytes and the call counts are exact, and the wire
way computes the very numbers the in-process way does (same loss)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from benchmarks.lab import lab_unavailable
from tests.helpers.common import REPO

# the tiny mode: micro-batch B = 2 sequences of T = 16 tokens, hidden H = 32, the char vocabulary V = 100;
# 2 micro-batches per step (one straight, one with CheckFree+'s swapped order), 1 timed step
B, T, H, V = 2, 16, 32, 100
IDS = 3 * B * T * 8  # input_ids, position_ids, attention_mask: int64 each = 768
HIDDEN = B * T * H * 4  # float32 hidden states (or their gradient) = 4096
MASKS = 2 * B * T * 8  # position_ids and attention_mask travel with every hop = 512
LOGITS = B * T * V * 4  # float32 logits (or their gradient) = 12800
CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK")  # the unit of a process's CPU time in /proc


def is_whole(count: float) -> bool:
    """Whether a count rebuilt from a mean (mean x how many it is over) is a whole number, up to float rounding."""
    return count > -1e-6 and math.isclose(count, round(count), abs_tol=1e-6)


def run_benchmark(*args: str, timeout: int) -> dict:
    """benchmarks/pipeline_throughput.py with `args`, which must succeed: its summary, the JSON of its last line."""
    result = subprocess.run(
        [sys.executable, "benchmarks/pipeline_throughput.py", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.integration
def test_tiny_run_reports_every_figure_with_the_bytes_the_shapes_imply():
    summary = run_benchmark("--tiny", "--stages", "2", timeout=900)
    assert summary["benchmark"] == "pipeline_throughput" and len(summary["load_average"]) == 3
    tiny = summary["sizes"]["tiny"]
    assert tiny["tokens_per_step"] == 2 * B * T == 64
    assert tiny["micro_batch"] == [B, T, H] and tiny["vocab_size"] == V
    ways = tiny["ways"]
    assert set(ways) == {"one_process", "local 2", "wire 2"}
    for way in ways.values():
        assert way["step_s"] > 0 and math.isfinite(way["loss_last"])
        assert math.isclose(way["tokens_per_s"], 64 / way["step_s"])
    assert ways["one_process"]["vs_one_process"] == 1.0
    # the same stages computing the same micro-batches: the wire changes the time, not the numbers
    assert ways["wire 2"]["loss_last"] == ways["local 2"]["loss_last"]
    # S = 2: the straight micro-batch makes 2 hops, (0: embed+layers) and (1: layers+head); the swapped one 4,
    # (0: embed), (1: layers), (0: layers), (1: head): 3 hops per micro-batch on average
    straight_out, swapped_out = IDS + (HIDDEN + MASKS), IDS + 3 * (HIDDEN + MASKS)  # 5376, 14592
    straight_in, swapped_in = HIDDEN + LOGITS, 3 * HIDDEN + LOGITS  # 16896, 25088
    # backward: the logits' gradient to the head's hop, a hidden gradient to each hop before it; every hop but the
    # embedding's sends back its input's gradient
    back_straight_out, back_swapped_out = LOGITS + HIDDEN, LOGITS + 3 * HIDDEN  # 16896, 25088
    back_straight_in, back_swapped_in = HIDDEN, 3 * HIDDEN  # 4096, 12288
    expected = {
        "forward_out": (straight_out + swapped_out) / 2,  # 9984
        "forward_in": (straight_in + swapped_in) / 2,  # 20992
        "backward_out": (back_straight_out + back_swapped_out) / 2,  # 20992
        "backward_in": (back_straight_in + back_swapped_in) / 2,  # 8192
    }
    assert expected == {"forward_out": 9984, "forward_in": 20992, "backward_out": 20992, "backward_in": 8192}
    # a p2p stream that breaks sends the micro-batch again: the calls its broken attempt completed are counted apart
    # (seen in a clean-clone run on a quiet machine: one extra hop-0 forward), and never in-process
    assert ways["local 2"]["retried_calls"] == 0
    assert set(ways["local 2"]["retried_bytes_per_micro_batch"].values()) == {0}
    for way in ("local 2", "wire 2"):
        assert ways[way]["bytes_per_micro_batch"] == expected
        assert ways[way]["hops_per_micro_batch"] == 3
        calls = ways[way]["calls"]
        assert calls["step"] == 2 and calls["forward"] + calls["backward"] == 12 + ways[way]["retried_calls"]
    assert set(ways["wire 2"]["overhead_ms"]) == {"forward", "backward", "step"}
    assert all(math.isfinite(ms) for ms in ways["wire 2"]["overhead_ms"].values())
    # the servers' own account of the same calls: every call the driver got an answer to was served (a broken
    # attempt's call may have been served too), its phases adding up to its total. How that total compares with the
    # driver's wait is a figure of the benchmark, not a check: two processes timing on a loaded machine (a clean-clone
    # run beside three benchmarks saw a server's 12.3 ms mean a call against the driver's 6.3 ms)
    served = ways["wire 2"]["server_ms_per_call"]
    assert set(served) == {"forward", "backward"}
    for op, split in served.items():
        answered = ways["wire 2"]["calls"][op]  # every answered call of the timed steps, broken attempts' included
        assert split["calls"] >= answered
        phases = ("read", "lock", "compute", "checks", "onward", "reply")
        # each phase is timed around code every call runs (an onward that passes nothing on included)
        assert all(split[phase] > 0 for phase in phases), split
        assert math.isclose(split["total"], sum(split[p] for p in phases))
        assert split["onward"] < 1, "hop by hop, no call waits for another server"
    # what the torch work cost its worker thread, on the servers and in this process alike: CPU no more than the wall
    # time it ran in (one thread), page faults counted
    local = ways["local 2"]["compute_per_call"]
    assert set(local) == {"forward", "backward"}
    for op in ("forward", "backward"):
        for work, calls in ((served[op], served[op]["calls"]), (local[op], ways["local 2"]["calls"][op])):
            assert 0 < work["compute_cpu"] <= work["compute"]
            # a mean over the calls counted of page faults counted: a whole number in all (none, with the freed
            # memory kept, is a right answer)
            assert is_whole(work["compute_faults"] * calls), (op, work, calls)


@pytest.mark.integration
def test_transport_floor_echoes_every_size_through_both_ways_and_reports_each_figure():
    """The wire alone: a framed echo through two real p2p daemons and through plain TCP on 127.0.0.1; the benchmark
    itself checks that every echo came back byte for byte (it exits non-zero otherwise)."""
    sizes = [4096, 70_000]  # the second spans several of the stream reader's 64 KiB chunks
    floor = run_benchmark("--transport-floor", "--floor-calls", "2", "--floor-bytes", *map(str, sizes), timeout=300)[
        "transport_floor"
    ]
    assert floor["calls"] == 2
    assert sorted(map(int, floor["bytes"])) == sizes
    for size, row in floor["bytes"].items():
        for way in ("p2p", "tcp"):
            figures = row[way]
            assert figures["round_trip_ms"] > 0 and figures["python_cpu_ms"] > 0  # this process ran both ends
            # the kernel counts the daemons' CPU in clock ticks (psutil reads /proc): two small echoes may cost them
            # none, so what can be checked is that the figure is whole ticks over the calls counted
            assert is_whole(figures["daemons_cpu_ms"] * floor["calls"] * CLOCK_TICKS_PER_S / 1000), figures
            assert math.isclose(figures["mb_per_s_each_way"], int(size) / figures["round_trip_ms"] * 1000 / 1e6)
        assert math.isclose(row["p2p_excess_ms"], row["p2p"]["round_trip_ms"] - row["tcp"]["round_trip_ms"])


@pytest.mark.integration
@pytest.mark.skipif(lab_unavailable() is not None, reason=str(lab_unavailable()))
def test_lab_run_reports_its_step_and_the_servers_phases_of_every_call_it_made():
    """--lab: two `serve` processes and a `drive` in namespaces of their own on shaped links. The step comes from the
    driver's metrics, and the servers' phases per call from their stage.json before and after the driver, which ran
    2 steps (one untimed) of 2 micro-batches through S = 2: 6 forward and 6 backward calls a step (see the tiny run's
    hops above), more if a broken stream made the driver send a call again. With --lab-uploads the run is made again
    while each server's host uploads to a store on a lab node of its own, after one upload from each host alone."""
    lab = run_benchmark("--tiny", "--stages", "2", "--lab", "50", "--lab-uploads", "0.2", timeout=900)["lab"]["tiny"]
    assert lab["one_process_step_s"] > 0 and lab["tokens_per_step"] == 2 * B * T
    run, uploading = lab["runs"]
    assert run["variant"] == "plain" and run["mbit"] == 50.0 and run["steps"] == 1 and not run["uploading"]
    assert uploading["variant"] == "plain" and uploading["uploading"] and uploading["steps"] == 1
    assert math.isclose(uploading["step_vs_without_uploads"], uploading["step_s"] / run["step_s"])
    assert uploading["upload_s"] and all(seconds > 0 for seconds in uploading["upload_s"])
    alone = lab["upload_alone_s"]["50"]
    assert len(alone) == 2 and all(seconds > 0 for seconds in alone)  # one upload from each server's host
    assert math.isclose(run["tokens_per_s"], 2 * B * T / run["step_s"])
    served = run["server_ms_per_call"]
    assert set(served) == {"forward", "backward"}
    for split in served.values():
        assert split["calls"] >= 12
        phases = ("read", "lock", "compute", "checks", "onward", "reply")
        assert all(split[phase] > 0 for phase in phases), split  # each timed around code every call runs
        assert math.isclose(split["total"], sum(split[p] for p in phases))
        assert split["onward"] < 1, "hop by hop, no call waits for another server"
        assert 0 < split["compute_cpu"] <= split["compute"]


@pytest.mark.integration
@pytest.mark.skipif(lab_unavailable() is not None, reason=str(lab_unavailable()))
def test_lab_transport_floor_echoes_across_two_namespaces_and_charges_each_way_against_the_link_rate():
    """--transport-floor --lab: the echo from one lab namespace to another, through p2p daemons and plain TCP, on a
    shaped link; each echo is checked byte for byte (the benchmark exits non-zero otherwise), and the figures are
    the round trips against the payload at the rate, with both namespaces' TCP trouble counted."""
    sizes = [4096, 70_000]
    floor = run_benchmark(
        "--transport-floor", "--lab", "50", "--floor-calls", "2", "--floor-gap-s", "0.05",
        "--floor-bytes", *map(str, sizes), timeout=600,
    )["lab_transport_floor"]  # fmt: skip
    assert floor["calls"] == 2 and floor["gap_s"] == 0.05
    assert list(floor["rates"]) == ["50.0"]
    rate = floor["rates"]["50.0"]
    assert sorted(map(int, rate["bytes"])) == sizes
    for size, row in rate["bytes"].items():
        assert row["p2p"] > 0 and row["tcp"] > 0
        assert math.isclose(row["payload_at_rate_ms"], 1000 * 2 * int(size) * 8 / 50e6)
        assert math.isclose(row["tcp_beyond_payload_ms"], row["tcp"] - row["payload_at_rate_ms"])
        assert math.isclose(row["p2p_beyond_tcp_ms"], row["p2p"] - row["tcp"])
    assert set(rate["tcp_trouble"]) == {"TcpRetransSegs", "TcpExtTCPTimeouts", "TcpExtTCPLossProbes"}
    assert all(isinstance(n, int) for n in rate["tcp_trouble"].values())
    # a count is what a namespace's counter rose by, and one the benchmark could not read would show as 0 too: a lab
    # namespace's counters are read in full, so a 0 above is no trouble
    from benchmarks.lab import Lab
    from benchmarks.throughput.floor import TCP_TROUBLE, tcp_counters

    with Lab(1, host_link=False) as lab:
        assert set(tcp_counters(lab.ns(0))) == set(TCP_TROUBLE) == set(rate["tcp_trouble"])


@pytest.mark.integration
def test_check_cost_times_both_checks_of_every_size_and_dtype():
    """--check-cost: the shipped check of a received tensor against torch.isfinite, for float32 and bfloat16 of each
    size; the benchmark itself exits non-zero if the two checks disagree on a tensor with a NaN."""
    cost = run_benchmark("--check-cost", "--floor-calls", "2", "--floor-bytes", "4096", "65536", timeout=300)[
        "check_cost"
    ]
    assert cost["repeats"] == 2 and cost["threads"] == 1
    assert sorted(cost["ms"]) == ["4096 bfloat16", "4096 float32", "65536 bfloat16", "65536 float32"]
    for row in cost["ms"].values():
        assert row["torch"] > 0 and row["shipped"] > 0
        assert math.isclose(row["torch_over_shipped"], row["torch"] / row["shipped"])


@pytest.mark.integration
def test_protobuf_cost_times_both_implementations_on_the_same_messages():
    """--protobuf-cost: each implementation of google.protobuf in its own interpreter (the benchmark exits non-zero if
    the environment did not pick the one asked for, or a message does not round-trip byte for byte)."""
    cost = run_benchmark("--protobuf-cost", "--floor-calls", "3", timeout=300)["protobuf_cost"]
    assert cost["repeats"] == 3
    assert set(cost["us_per_message"]) == {"upb", "python"}
    for name, ratio in cost["python_over_upb"].items():
        upb, python = cost["us_per_message"]["upb"][name], cost["us_per_message"]["python"][name]
        assert upb["bytes"] == python["bytes"] > 0  # the same message in both
        assert math.isclose(ratio, python["us"] / upb["us"])


def test_bytes_per_micro_batch_count_each_micro_batch_once_and_its_broken_attempts_apart():
    """Hand-made calls: micro-batch 0 went through on its first attempt; micro-batch 1's first attempt completed
    its hop-0 forward before its route broke, and its second attempt went through."""
    from benchmarks.throughput.calls import summarize_calls

    def row(op: str, micro_batch: str, attempt: int, out: int, into: int) -> dict:
        return {"op": op, "s": 0.01, "micro_batch": micro_batch, "attempt": attempt, "out": out, "in": into}

    rows = [
        row("forward", "s1-m0", 0, 100, 10),
        row("forward", "s1-m0", 0, 20, 30),
        row("backward", "s1-m0", 0, 30, 20),
        row("forward", "s1-m1", 0, 100, 10),  # the broken attempt's one completed call
        row("forward", "s1-m1", 1, 100, 10),
        row("forward", "s1-m1", 1, 20, 30),
        row("backward", "s1-m1", 1, 30, 20),
    ]
    summary = summarize_calls(rows, micro_batches=2)
    assert summary["bytes_per_micro_batch"] == {
        "forward_out": 120.0,
        "forward_in": 40.0,
        "backward_out": 30.0,
        "backward_in": 20.0,
    }
    assert summary["hops_per_micro_batch"] == 2 and summary["retried_calls"] == 1
    assert summary["retried_bytes_per_micro_batch"] == {
        "forward_out": 50.0,
        "forward_in": 5.0,
        "backward_out": 0.0,
        "backward_in": 0.0,
    }
    assert summary["calls"] == {"forward": 5, "backward": 2}


@pytest.mark.integration
def test_loss_check_trains_one_process_on_the_pipeline_s_micro_batches_from_the_same_weights():
    """--loss-check's one-process ways see the micro-batches the driver walks, from the same initial weights: the
    first step's loss is the pipeline's, and a whole model untied and clipped stage by stage is the pipeline, step
    after step (without CheckFree+'s swapped order on odd micro-batches, the one thing it cannot do)."""
    check = run_benchmark(
        "--tiny", "--stages", "4", "--loss-check", "4", "--loss-check-one-process", "tied", "untied-stage-clip",
        "--set", "pipeline.checkfree_plus=false", timeout=600,
    )["loss_check"][0]  # fmt: skip
    ways = {"one_process", "one_process untied-stage-clip", "plain"}
    assert set(check["loss_first"]) == set(check["loss_tenths"]) == set(check["val_loss"]) == ways
    assert math.isclose(check["loss_first"]["one_process"], check["loss_first"]["plain"], abs_tol=1e-4)
    for mine, pipeline in zip(check["loss_tenths"]["one_process untied-stage-clip"], check["loss_tenths"]["plain"]):
        assert math.isclose(mine, pipeline, abs_tol=1e-4)
    assert math.isclose(check["val_loss"]["one_process untied-stage-clip"], check["val_loss"]["plain"], abs_tol=1e-4)
    # the tied model's second step already differs: its one embedding takes both copies' gradients
    assert check["loss_tenths"]["one_process"][-1] != check["loss_tenths"]["plain"][-1]
    # the pipeline validated again with each end stage's layers replaced by its neighbour's (and put back after)
    copied = check["val_loss_end_stage_copied"]
    assert set(copied) == {"plain"} and set(copied["plain"]) == {"stage 0", "stage 3"}
    assert all(math.isfinite(v) and v != check["val_loss"]["plain"] for v in copied["plain"].values())


def test_recovery_stalls_are_grouped_by_size_way_and_method():
    from benchmarks.throughput.recovery import print_stalls

    def event(way: str, method: str, stall: float, load: float | None, waited: float | None) -> dict:
        return {"way": way, "method": method, "stall_s": stall, "spare_load_s": load, "waited_s": waited}

    events = {
        "27M": [
            event("plain", "checkfree", 1.0, 0.5, 0.5),
            event("plain", "replica failover", 0.1, None, None),  # failover: the driver never waits
            event("poll1", "checkfree", 3.0, 0.5, 2.0),
            event("plain", "checkfree", 2.0, 0.7, 1.5),  # a second repeat of the same way and method
        ]
    }
    table = print_stalls(events)
    assert table == {
        "27M plain": {
            "checkfree": {
                "mean": 1.5,
                "min": 1.0,
                "max": 2.0,
                "n": 2,
                "waited_mean": 1.0,
                "waited_min": 0.5,
                "waited_max": 1.5,
            },
            "replica failover": {"mean": 0.1, "min": 0.1, "max": 0.1, "n": 1},
        },
        "27M poll1": {
            "checkfree": {
                "mean": 3.0,
                "min": 3.0,
                "max": 3.0,
                "n": 1,
                "waited_mean": 2.0,
                "waited_min": 2.0,
                "waited_max": 2.0,
            }
        },
    }


@pytest.mark.slow
def test_recovery_kills_each_way_s_servers_and_every_spare_rebuilds_its_stage():
    """--recovery --tiny with a variant: both ways lose a replica, then stage 1 and stage 3 with a warm spare each,
    and each spare rebuilds the stage by the method its place calls for, under that way's settings."""
    summary = run_benchmark("--tiny", "--recovery", "--variant", "poll1:pipeline.rebuild_poll_s=1", timeout=1500)
    events = summary["recovery_s_by_method"]["tiny"]
    assert [(e["way"], e["method"], e["spare_method"]) for e in events] == [
        (way, method, spare)
        for way in ("plain", "poll1")
        for method, spare in (
            ("replica failover", None),
            ("checkfree", "checkfree"),
            ("checkfree_plus", "checkfree_plus"),
        )
    ]
    assert {e["way"]: e["rebuild_poll_s"] for e in events} == {"plain": 0.25, "poll1": 1.0}
    assert all(e["servers_before_kill"] >= 1 for e in events)  # the killed server was in the map
    # the driver saw each rebuilt stage lost and back, and waited for it less than the stall's step took in all
    assert all(e["driver_recovery"] and 0 < e["waited_s"] for e in events if e["spare_method"])
    assert set(summary["stall_s_by_way_and_method"]) == {"tiny plain", "tiny poll1"}
