"""The web dashboard: its bounded sources, its HTTP server, the peers table's width, and the page
rendered by a real browser (headless Chromium) from a live two-node swarm."""

from __future__ import annotations

import asyncio
import io
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from rich.console import Console

from node.dashboard.server import MAX_REQUEST_BYTES, DashboardServer
from node.dashboard.sources import DashboardSources, MetricsTail, PeerHistory
from tests.helpers.browser import chart_points, run_chromium
from tests.helpers.common import CLI_TIMEOUT_S, REPO, cli, get_json
from tests.helpers.swarm import SwarmProcess, peers_listed, wait_for

PEER_ROW = dict(
    node_id="12D3KooWAbcdefghijklmnop",
    display_name="a-rather-long-node-name",
    round=123,
    policy_version=120,
    reward_mean=0.1234,
    accuracy=0.4567,
    rollouts_published=1234,
    rollouts_received=5678,
    rollouts_accepted=5000,
    rollouts_rejected=12,
    outer_steps=3,
    outer_steps_skipped=1,
    tokens_per_s=1234.5,
    uptime_s=3600.0,
    last_seen=0.0,
    accuracy_by_dataset={"basic_arithmetic": 0.5, "fraction_simplification": 0.25},
    device="cuda:0 NVIDIA GeForce RTX 4090",
    rejoins=2,
)


# the peers table ---------------------------------------------------------------------------------


@pytest.mark.parametrize("width", [80, 60, 120, 200, 220])
def test_peers_table_fits_the_terminal_with_whole_headers(width):
    from node.dashboard.tables import PEER_COLUMNS, peers_table

    console = Console(width=width, file=io.StringIO(), record=True)
    rows = [dict(PEER_ROW, last_seen=time.time()), dict(PEER_ROW, node_id="12D3KooWzzzz", last_seen=time.time())]
    console.print(peers_table(rows, "test", console.width))
    text = console.export_text()
    assert max(map(len, text.splitlines())) <= width
    assert "…" not in text  # nothing cut: neither headers ("no…") nor cells
    header = next(line for line in text.splitlines() if "round" in line)
    shown = [name for name, _, _ in PEER_COLUMNS if re.search(rf"[┃│ ]{re.escape(name)}[ ┃│]", header)]
    assert {"node", "round", "reward", "accuracy"} <= set(shown)
    if width >= 220:  # every column at once
        assert len(shown) == len(PEER_COLUMNS) and "not shown" not in text
    else:
        hidden = text[text.index("not shown for width:") :]
        assert all(name in hidden for name, _, _ in PEER_COLUMNS if name not in shown)


OVERLAP = dict(
    staleness_mean=0.3, staleness_max=2, carried_in=None, carried_out=None, ahead_wait_s=1.25, sampler_idle_s=0.5
)


def test_peers_table_shows_the_overlap_columns_only_when_a_peer_reports_them():
    """A node whose generation overlaps its training reports staleness, carried completions and its wait (protocol
    1.10), and its sampler's idle time (1.11): `peers` shows a column for each some peer reports, and the table of
    peers that report none (the default config, an older peer) is the table without them."""
    from node.dashboard.tables import OVERLAP_COLUMNS, PEER_COLUMNS, peers_table

    def render(rows: list[dict], width: int) -> tuple[list[str], str]:
        console = Console(width=width, file=io.StringIO(), record=True)
        console.print(peers_table(rows, "test", console.width))
        text = console.export_text()
        header = next(line for line in text.splitlines() if "round" in line)
        names = [name for name, _, _ in PEER_COLUMNS + OVERLAP_COLUMNS]
        found = {name: re.search(rf"[┃│ ]{re.escape(name)}[ ┃│]", header) for name in names}
        return sorted((name for name in names if found[name]), key=lambda name: found[name].start()), text

    now = time.time()
    off = dict(PEER_ROW, last_seen=now, **dict.fromkeys(OVERLAP))  # nil on the wire: the feature is off
    older = dict(PEER_ROW, node_id="12D3KooWold", last_seen=now)  # a 1.9 peer: no such keys at all
    shown, text = render([off, older], 220)
    assert shown == [name for name, _, _ in PEER_COLUMNS] and "not shown" not in text

    on = dict(PEER_ROW, node_id="12D3KooWon", last_seen=now, **OVERLAP)
    shown, text = render([off, on, older], 260)
    assert (
        shown[-6:] == ["rejoins", "restarts", "stale", "waited", "idle", "seen"] and "carried" not in shown
    )  # nobody carries any
    line = next(line for line in text.splitlines() if "12D3KooWon" in line)
    assert "0.3/2" in line and "1.2s" in line and "0.5s" in line
    line = next(line for line in text.splitlines() if "12D3KooWold" in line)
    assert "0.3/2" not in line and "1.2s" not in line and "0.5s" not in line
    minor_10 = {key: value for key, value in on.items() if key != "sampler_idle_s"}  # waits, but says nothing of idling
    shown, text = render([off, minor_10], 260)
    assert shown[-5:] == ["rejoins", "restarts", "stale", "waited", "seen"] and "idle" not in shown
    shown, text = render([dict(on, carried_in=4, carried_out=0)], 260)
    assert "carried" in shown and "4/0" in text
    shown, text = render([on], 80)  # too narrow: left out, and said
    assert "stale" not in shown and "stale" in text[text.index("not shown for width:") :]


# bounded sources -----------------------------------------------------------------------------------


def test_peer_history_is_bounded_and_keeps_by_dataset_fields():
    history = PeerHistory(max_peers=3, max_points=5)
    for t in range(10):
        history.add([dict(PEER_ROW, node_id="steady", last_seen=float(t), accuracy_by_dataset={"a": 0.5})])
        # the same heartbeat read twice is one point
        history.add([dict(PEER_ROW, node_id="steady", last_seen=float(t))])
    points = history.snapshot()["steady"]
    assert [p["time"] for p in points] == [5.0, 6.0, 7.0, 8.0, 9.0]
    assert points[-1]["accuracy_by_dataset"] == {"a": 0.5} and points[-1]["reward_mean"] == PEER_ROW["reward_mean"]
    history.add([dict(PEER_ROW, node_id=f"new{i}", last_seen=0.0) for i in range(3)])
    assert list(history.snapshot()) == ["new0", "new1", "new2"]  # the least recently seen peer dropped first


def test_metrics_tail_reads_new_rows_only_and_starts_over_when_rewritten(tmp_path):
    from node.state import StateStore

    store = StateStore(tmp_path)
    tail = MetricsTail(store.metrics_path, max_rows=3)
    assert tail.read() == []
    for round_ in range(1, 5):
        store.append_metrics({"round": round_})
    with open(store.metrics_path, "a") as handle:
        handle.write('{"round": 5, "cut by a ki')  # a line without its newline yet
    assert [r["round"] for r in tail.read()] == [2, 3, 4]
    with open(store.metrics_path, "a") as handle:
        handle.write('ll": 1}\n')
    assert [r["round"] for r in tail.read()] == [3, 4, 5]
    store.truncate_metrics(2)  # resume: rows newer than the checkpoint dropped by an atomic rewrite
    assert [r["round"] for r in tail.read()] == [1, 2]


# the HTTP server -------------------------------------------------------------------------------------


async def _request(port: int, raw: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    await writer.drain()
    try:
        return await asyncio.wait_for(reader.read(), 30)
    finally:
        writer.close()


def test_server_routes_json_static_files_and_refuses_the_rest(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"round": 1, "loss": 1.0}).replace("1.0", "NaN") + "\n")
    sources = DashboardSources(
        None, tmp_path / "metrics.jsonl", lambda: {"stats": {"totals": {"rejected": {"replay": 2}}}}
    )

    async def scenario():
        server = DashboardServer("127.0.0.1", 0, sources)
        await server.start()
        try:
            get = lambda path: _request(server.port, b"GET " + path + b" HTTP/1.1\r\nHost: x\r\n\r\n")  # noqa: E731
            replies = {
                path: await get(path)
                for path in (
                    b"/",
                    b"/static/app.js",
                    b"/static/style.css",
                    b"/api/peers",
                    b"/api/metrics",
                    b"/api/swarm",
                    b"/api/stages",
                    b"/api/history",
                    b"/static/../server.py",
                    b"/nowhere",
                )
            }
            replies["POST"] = await _request(server.port, b"POST /api/peers HTTP/1.1\r\n\r\n")
            replies["huge"] = await _request(
                server.port, b"GET /" + b"a" * (2 * MAX_REQUEST_BYTES) + b" HTTP/1.1\r\n\r\n"
            )
            return replies
        finally:
            await server.stop()

    replies = asyncio.run(scenario())
    status = {path: reply.split(b"\r\n", 1)[0] for path, reply in replies.items()}
    body = {path: reply.split(b"\r\n\r\n", 1)[-1] for path, reply in replies.items()}
    for path in (
        b"/",
        b"/static/app.js",
        b"/static/style.css",
        b"/api/peers",
        b"/api/metrics",
        b"/api/swarm",
        b"/api/stages",
        b"/api/history",
    ):
        assert status[path] == b"HTTP/1.1 200 OK", path
    assert b'id="peer-rows"' in body[b"/"] and b"renderStages" in body[b"/static/app.js"]
    assert (
        json.loads(body[b"/api/peers"]) == []
        and json.loads(body[b"/api/stages"]) == []
        and json.loads(body[b"/api/history"]) == {}
    )
    assert json.loads(body[b"/api/metrics"]) == [{"round": 1, "loss": None}]  # NaN is not JSON: sent as null
    assert json.loads(body[b"/api/swarm"])["stats"]["totals"]["rejected"] == {"replay": 2}
    assert status[b"/static/../server.py"].startswith(b"HTTP/1.1 404") and status[b"/nowhere"].startswith(
        b"HTTP/1.1 404"
    )
    assert status["POST"].startswith(b"HTTP/1.1 405")
    assert replies["huge"] == b""  # a request head over the limit gets nothing


@pytest.mark.integration
def test_browser_shows_the_overlap_only_where_the_node_and_its_peers_have_it(tmp_path):
    """The page from a server whose sources are set by hand (no swarm): with the overlap keys in the metrics rows and
    a peer's heartbeat, the overlap section's charts and the peers' columns are drawn; without them, neither."""
    from node.dashboard.sources import SwarmWatcher

    def dom_of(name: str, peers: list[dict], rows: list[dict]) -> str:
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        watcher = SwarmWatcher(lambda: None, None)
        watcher.peers = peers
        sources = DashboardSources(watcher, tmp_path / name / "metrics.jsonl", lambda: {})

        async def scenario():
            server = DashboardServer("127.0.0.1", 0, sources)
            await server.start()
            try:
                url = f"http://127.0.0.1:{server.port}/"
                profile = tmp_path / name / "chromium-profile"
                return await asyncio.to_thread(run_chromium, profile, "--virtual-time-budget=5000", "--dump-dom", url)
            finally:
                await server.stop()

        return asyncio.run(scenario())

    base = {"reward_mean": 0.5, "accuracy": 0.25, "tokens_per_s": 10.0, "step_s": 1.0, "policy_version": 1}
    rows = [
        {"round": 1, **base, "staleness_mean": 0.0, "staleness_max": 0, "carried_in": 0, "carried_out": 2},
        {"round": 2, **base, "staleness_mean": 0.5, "staleness_max": 1, "carried_in": 2, "carried_out": 1},
        {"round": 3, **base, "staleness_mean": 0.25, "staleness_max": 1, "carried_in": 1, "carried_out": 0},
    ]
    peer = dict(PEER_ROW, last_seen=time.time(), **OVERLAP)
    dom = dom_of("on", [peer], rows)
    assert 'data-state="ok"' in dom, dom[:3000]
    assert re.search(r'<section id="overlap-section"[^>]*>', dom).group(0) == '<section id="overlap-section">'
    assert chart_points(dom, "node-staleness") == 6 and chart_points(dom, "node-carried") == 6
    assert chart_points(dom, "node-ahead-wait") == 0  # no rollouts generated ahead: over_sample only
    head = re.search(r'<thead id="peer-head">.*?</thead>', dom).group(0)
    assert ">stale<" in head and ">waited<" in head and ">carried<" not in head
    assert ">idle<" in head
    row = re.search(r"<tr[^>]*data-peer-row.*?</tr>", dom).group(0)
    assert "0.3/2" in row and "1.3s" in row and "0.5s" in row, row  # toFixed rounds 1.25 up

    # rollout.max_staleness 1: both sides of the overlap's idle time charted, none in the first round
    ahead = [
        {"round": 1, **base, "staleness_mean": 0.0, "staleness_max": 0, "ahead_wait_s": None, "sampler_idle_s": None},
        {"round": 2, **base, "staleness_mean": 1.0, "staleness_max": 1, "ahead_wait_s": 0.5, "sampler_idle_s": 0.25},
        {"round": 3, **base, "staleness_mean": 1.0, "staleness_max": 1, "ahead_wait_s": 0.0, "sampler_idle_s": 1.5},
    ]
    minor_10 = {key: value for key, value in peer.items() if key != "sampler_idle_s"}
    dom = dom_of("ahead", [minor_10], ahead)
    assert 'data-state="ok"' in dom, dom[:3000]
    assert chart_points(dom, "node-ahead-wait") == 4
    assert re.search(r'<path[^>]*data-series="sampler_idle_s"[^>]*data-points="2"', dom), dom[:3000]
    head = re.search(r'<thead id="peer-head">.*?</thead>', dom).group(0)
    assert ">waited<" in head and ">idle<" not in head  # a 1.10 peer says nothing of its sampler

    off = dict(PEER_ROW, last_seen=time.time(), **dict.fromkeys(OVERLAP))  # the default config: nil
    dom = dom_of("off", [off], [{"round": 1, **base}])
    assert 'data-state="ok"' in dom and 'data-peer-row=""' in dom
    assert re.search(r'<section id="overlap-section"[^>]*>', dom).group(0) == '<section id="overlap-section" hidden="">'
    head = re.search(r'<thead id="peer-head">.*?</thead>', dom).group(0)
    assert (
        ">stale<" not in head
        and ">waited<" not in head
        and ">idle<" not in head
        and ">rejoins<" in head
        and ">restarts<" in head
    )


def test_shipped_page_loads_nothing_from_elsewhere():
    static = Path(__file__).resolve().parents[1] / "node" / "dashboard" / "static"
    for path in static.iterdir():
        assert not re.search(r"(src|href)=\"(https?:)?//", path.read_text()), f"{path.name} loads from another host"
        assert "fetch(\"http" not in path.read_text()


# a live swarm in a real browser -------------------------------------------------------------------


@pytest.mark.integration
def test_browser_renders_peers_and_curves_of_a_live_swarm(evaluating_swarm_yaml, tmp_path, cli_env):
    first = SwarmProcess(
        evaluating_swarm_yaml,
        tmp_path / "a",
        cli_env,
        extra=["--set", "swarm.dashboard_port=0", "--set", "name=node-a"],
    )
    nodes = [first]
    viewer = viewer_log = None
    try:
        bootstrap = first.addresses()
        nodes.append(
            SwarmProcess(evaluating_swarm_yaml, tmp_path / "b", cli_env, bootstrap, extra=["--set", "name=node-b"])
        )
        url = wait_for(
            lambda: (
                first.assert_running()
                or (
                    (tmp_path / "a" / "dashboard.txt").exists()
                    and (tmp_path / "a" / "dashboard.txt").read_text().strip()
                )
            ),
            120,
            "node a's dashboard",
        )

        def ready():
            for node in nodes:
                node.assert_running()
            peers, metrics, history = (
                get_json(url + "api/peers"),
                get_json(url + "api/metrics"),
                get_json(url + "api/history"),
            )
            return (
                len(peers) == 2
                and len(metrics) >= 3
                and any("heldout_accuracy" in r for r in metrics)
                and sum(len(p) for p in history.values()) >= 3
            )

        wait_for(ready, 300, "two peers, three metrics rows and some heartbeat history on the dashboard", interval=1)

        # /api/peers is what `swarm-node peers --json` prints (the same function): same peers, same fields.
        from_cli = peers_listed(bootstrap[0], "test-swarm", cli_env, must_succeed=True)
        from_api = get_json(url + "api/peers")
        assert [r["node_id"] for r in from_cli] == [r["node_id"] for r in from_api] and [set(r) for r in from_cli] == [
            set(r) for r in from_api
        ]
        assert {r["display_name"] for r in from_api} == {"node-a", "node-b"}

        dom = run_chromium(tmp_path / "chromium-profile", "--virtual-time-budget=10000", "--dump-dom", url)
        assert len(re.findall(r"<tr[^>]*data-peer-row", dom)) == 2, dom[:3000]
        assert 'data-state="ok"' in dom
        assert (
            chart_points(dom, "node-reward") >= 3
            and chart_points(dom, "node-accuracy") >= 3
            and chart_points(dom, "peer-reward") >= 1
        )
        assert re.search(r'<path[^>]*data-series="reward_mean"[^>]*data-points="([3-9]|\d\d+)"', dom), (
            "no reward curve with points"
        )
        assert re.search(r'<path[^>]*data-series="heldout_accuracy"', dom), "no held-out accuracy curve"
        assert 'data-pipeline-count="0"' in dom  # the stage map section is there, empty without stage servers

        screenshot = tmp_path / "dashboard.png"
        run_chromium(tmp_path / "chromium-profile", "--virtual-time-budget=10000", f"--screenshot={screenshot}", url)
        assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and screenshot.stat().st_size > 10_000
        print(f"dashboard screenshot: {screenshot}")

        # The client-only viewer serves the same peers without training.
        viewer_log = open(tmp_path / "viewer.out", "w")
        viewer = subprocess.Popen(
            cli(
                "dashboard",
                "--initial-peers",
                bootstrap[0],
                "--swarm-id",
                "test-swarm",
                "--port",
                "0",
                "--state-dir",
                str(tmp_path / "b"),
            ),
            stdout=viewer_log,
            stderr=subprocess.STDOUT,
            env=cli_env,
            cwd=REPO,
            start_new_session=True,
        )
        viewer_url = wait_for(
            lambda: (
                (m := re.search(r"(http://127\.0\.0\.1:\d+/)", (tmp_path / "viewer.out").read_text())) and m.group(1)
            ),
            120,
            "the viewer's URL",
        )
        wait_for(lambda: len(get_json(viewer_url + "api/peers")) == 2, 120, "the viewer to list both peers", interval=1)
        assert get_json(viewer_url + "api/metrics") and get_json(viewer_url + "api/swarm")["node"]["viewer"] is True
        os.killpg(viewer.pid, signal.SIGINT)
        assert viewer.wait(timeout=CLI_TIMEOUT_S) == 0, (tmp_path / "viewer.out").read_text()[-2000:]
    finally:
        if viewer is not None and viewer.poll() is None:
            os.killpg(viewer.pid, signal.SIGKILL)
            viewer.wait(timeout=30)
        if viewer_log is not None:
            viewer_log.close()
        for node in nodes:
            node.close()
