"""The viewing commands start at once: `stats`, `peers` and the dashboard's viewer load no model library.

Each command runs as `python -X importtime -m node.cli ...`. That log lists every module the process loaded, nested
under the module that imported it, so a failure names the chain (`torch <- node.model <- node.state <- ...`).
`stats` loads neither torch nor transformers. `peers` and the viewer reach the DHT through hivemind, and hivemind
imports torch itself (hivemind/__init__.py imports its averaging, moe and optim packages; hivemind/utils its tensor
descriptors), so for them torch may come in only through hivemind, and transformers not at all.
benchmarks/viewer_startup.py measures how fast `stats` starts; no test here checks a time.
"""

from __future__ import annotations

import ast
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from node.stats import SwarmStats
from tests.helpers.common import CLI_TIMEOUT_S, REPO, get_json

MODEL_LIBRARIES = ("torch", "transformers")


def logged_imports(stderr: str) -> list[tuple[int, str]]:
    """(depth, module) for each line of an `-X importtime` log, in its order. A module is logged once it has loaded,
    after the modules it imported, which are one level deeper."""
    imports = []
    for line in stderr.splitlines():
        fields = line.split("|", 2)
        if line.startswith("import time:") and len(fields) == 3 and fields[0].split(":")[1].strip().isdigit():
            imports.append(((len(fields[2]) - len(fields[2].lstrip(" ")) - 1) // 2, fields[2].strip()))
    return imports


def import_chain(imports: list[tuple[int, str]], module: str) -> list[str] | None:
    """`module`, the module that first imported it, the one that imported that, ... up to the command's own code;
    None when the process never loaded it."""
    for at, (depth, name) in enumerate(imports):
        if name == module:
            chain = [name]
            for outer_depth, outer in imports[at + 1 :]:
                if outer_depth < depth:  # the first shallower line after a module is what imported it
                    chain.append(outer)
                    depth = outer_depth
            return chain
    return None


def model_library_chains(stderr: str, torch_through_hivemind: bool = False) -> list[str]:
    """The chain that loaded each model library in the logged process; with `torch_through_hivemind`, not torch when
    a hivemind module imported it."""
    imports = logged_imports(stderr)
    assert imports, "no -X importtime log in the command's stderr"
    chains = []
    for library in MODEL_LIBRARIES:
        chain = import_chain(imports, library)
        if chain is None:
            continue
        if library == "torch" and torch_through_hivemind and len(chain) > 1 and chain[1].split(".")[0] == "hivemind":
            continue
        chains.append(" <- ".join(chain))
    return chains


def project_modules_loading_a_model_library(stderr: str) -> list[str]:
    """The project's modules in the log that import torch or transformers as they load. Once hivemind has loaded
    torch, a later `import torch` is not logged: the viewers' own modules are read instead."""
    found = []
    for module in sorted({name for _, name in logged_imports(stderr) if name.split(".")[0] in ("node", "protocol")}):
        path = REPO.joinpath(*module.split("."))
        source = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        if not source.is_file():
            continue
        imported = set()
        for statement in ast.parse(source.read_text()).body:
            if isinstance(statement, ast.Import):
                imported |= {alias.name for alias in statement.names}
            elif isinstance(statement, ast.ImportFrom) and statement.module and not statement.level:
                imported.add(statement.module)
        if any(name.split(".")[0] in MODEL_LIBRARIES for name in imported):
            found.append(module)
    return found


def assert_loads_no_model_library(command: str, stderr: str, torch_through_hivemind: bool = False) -> None:
    breaches = model_library_chains(stderr, torch_through_hivemind) + [
        f"{module} imports one at its top" for module in project_modules_loading_a_model_library(stderr)
    ]
    assert not breaches, f"{command} loaded a model library: " + "; ".join(breaches)


def viewing_command(*args: str) -> list[str]:
    return [sys.executable, "-X", "importtime", "-m", "node.cli", *args]


def run_viewing_command(*args: str) -> subprocess.CompletedProcess:
    result = subprocess.run(viewing_command(*args), capture_output=True, text=True, cwd=REPO, timeout=CLI_TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def write_state_dir(state_dir: Path, kind: str) -> None:
    """What `stats` reads in the state directory of a training node, a pipeline driver or a stage server."""
    state_dir.mkdir()
    rows = []
    if kind == "node":
        rows = [
            {
                "round": r,
                "policy_version": r,
                "time": 1000.0 + 2 * r,
                "step_s": 2.0,
                "reward_mean": 0.1 * r,
                "accuracy": 0.05 * r,
                "tokens_per_s": 100.0,
                "external_questions": 4,
                "reward_by_dataset": {"arithmetic": 0.1 * r},
                **({"heldout_accuracy": 0.5, "heldout_by_dataset": {"arithmetic": 0.5}} if r % 2 == 0 else {}),
            }
            for r in range(1, 11)
        ]
        stats = SwarmStats()
        stats.peer("a" * 16).batches_received += 3
        stats.save(state_dir / "swarm.json")
    elif kind == "pipeline driver":
        rows = [
            {"step": s, "loss": 3.0 / s, "step_s": 1.0, "retries": 0, "backward_failures": 0, "val_loss": 3.1 / s}
            for s in range(1, 11)
        ]
    else:
        (state_dir / "stage.json").write_text(json.dumps({"stage": 1, "model": "tiny"}))
        (state_dir / "recoveries.jsonl").write_text(json.dumps({"stage": 1, "source": "replica"}) + "\n")
    (state_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["node", "pipeline driver", "stage server"])
def test_stats_loads_no_model_library(kind, tmp_path):
    write_state_dir(tmp_path / "state", kind)
    as_json = run_viewing_command("stats", "--state-dir", str(tmp_path / "state"), "--json")
    assert json.loads(as_json.stdout)["state_dir"] == str(tmp_path / "state")
    table = run_viewing_command("stats", "--state-dir", str(tmp_path / "state"))
    for command, result in (("stats --json", as_json), ("stats", table)):
        assert_loads_no_model_library(f"`{command}` of a {kind}", result.stderr)


@pytest.mark.integration
def test_peers_and_the_dashboard_viewer_load_torch_only_through_hivemind_and_no_transformers(tmp_path):
    """Against a real DHT peer on 127.0.0.1 (an empty swarm: the commands read its heartbeats and stage maps all the
    same): `peers --json`, `peers --json --stages`, the `peers` table, and the viewer answering each of its routes."""
    from node.config import load_config
    from node.transport.joining import create_dht_node, shutdown_dht

    state_dir = tmp_path / "state"
    write_state_dir(state_dir, "node")

    def viewer_log(bootstrap: str) -> str:
        out, err = tmp_path / "viewer.out", tmp_path / "viewer.err"
        with open(out, "w") as stdout, open(err, "w") as stderr:
            viewer = subprocess.Popen(
                viewing_command(
                    *("dashboard", "--initial-peers", bootstrap, "--swarm-id", "viewing", "--port", "0"),
                    *("--state-dir", str(state_dir)),
                ),
                stdout=stdout,
                stderr=stderr,
                cwd=REPO,
                start_new_session=True,
            )
        try:
            deadline = time.monotonic() + CLI_TIMEOUT_S  # a hang guard, never a speed check
            while not (url := re.search(r"http://127\.0\.0\.1:\d+/", out.read_text())):
                assert viewer.poll() is None and time.monotonic() < deadline, err.read_text()[-3000:]
                time.sleep(0.5)
            for route in ("peers", "history", "metrics", "swarm", "stages"):
                get_json(url.group(0) + "api/" + route)
            os.killpg(viewer.pid, signal.SIGINT)
            assert viewer.wait(timeout=CLI_TIMEOUT_S) == 0, err.read_text()[-3000:]
        finally:
            if viewer.poll() is None:
                os.killpg(viewer.pid, signal.SIGKILL)
                viewer.wait(timeout=30)
        return err.read_text()

    async def logs_of_each_command() -> dict[str, str]:
        config = load_config(None, ["swarm.transport=dht", 'swarm.host_maddrs=["/ip4/127.0.0.1/tcp/0"]'])
        dht = await create_dht_node(config, client_mode=False)  # the bootstrap peer, in this process
        try:
            bootstrap = str((await dht.get_visible_maddrs())[0])
            logs = {}
            for extra in (["--json"], ["--json", "--stages"], []):
                command = ("peers", "--initial-peers", bootstrap, "--swarm-id", "viewing", *extra)
                logs[" ".join(["peers", *extra])] = (await asyncio.to_thread(run_viewing_command, *command)).stderr
            logs["dashboard (viewer)"] = await asyncio.to_thread(viewer_log, bootstrap)
            return logs
        finally:
            await shutdown_dht(dht)

    for command, stderr in asyncio.run(logs_of_each_command()).items():
        assert_loads_no_model_library(f"`{command}`", stderr, torch_through_hivemind=True)


def test_the_chain_that_loaded_a_model_library_is_read_from_the_log():
    """The check can fail: where node.state loaded torch and transformers, it names both chains."""
    log = "\n".join(
        [
            "import time: self [us] | cumulative | imported package",
            "import time:       100 |        100 |     torch._C",
            "import time:       100 |        200 |   torch",
            "import time:       100 |        100 |       transformers.utils",
            "import time:       100 |        200 |     transformers",
            "import time:       100 |        300 |   node.model",
            "import time:       100 |        600 | node.state",
            "import time:       100 |        100 |   torch_helpers",
            "import time:       100 |        200 | node.commands",
        ]
    )
    assert model_library_chains(log) == ["torch <- node.state", "transformers <- node.model <- node.state"]
    assert project_modules_loading_a_model_library(log) == ["node.model", "node.state"]
    through_hivemind = log.replace("node.state", "hivemind.utils.tensor_descr")
    assert model_library_chains(through_hivemind, torch_through_hivemind=True) == [
        "transformers <- node.model <- hivemind.utils.tensor_descr"
    ]


@pytest.mark.integration
def test_health_loads_no_model_library(tmp_path):
    """`health` is what a healthcheck runs every 30 s: it must not pay for torch. A real endpoint answers it."""
    import threading

    from node.stats import HTTP_FILE, MetricsServer

    state_dir = tmp_path / "state"
    state_dir.mkdir()
    loop = asyncio.new_event_loop()
    ready = {"ready": True, "status": "ready", "reason": "round 3 completed 1 s ago"}
    server = MetricsServer("127.0.0.1", 0, lambda: "", readiness=lambda: ready, url_file=state_dir / HTTP_FILE)
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        asyncio.run_coroutine_threadsafe(server.start(), loop).result(timeout=60)
        result = run_viewing_command("health", "--state-dir", str(state_dir))
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(), loop).result(timeout=60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=60)
    assert result.stdout == "ready (ready): round 3 completed 1 s ago\n"
    assert_loads_no_model_library("`health`", result.stderr)
