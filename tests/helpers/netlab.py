"""`swarm-node` commands in the swarm lab (benchmarks/lab/): each in its own network namespace, listening on its
lab address."""

from __future__ import annotations

from benchmarks.lab import Lab
from benchmarks.lab.presets import lab_command
from tests.helpers.swarm import wait_for


def start_command(
    lab: Lab,
    index: int,
    tmp_path,
    config,
    env,
    command: str = "join",
    bootstrap: list[str] = (),
    extra: list[str] = (),
    name: str = "lab",
) -> str:
    """Run `swarm-node COMMAND` as node `index` (state in tmp_path/n<index>, output in tmp_path/n<index>.out, display
    name <name>-<index>); its first address once it listens."""
    state = tmp_path / f"n{index}"
    argv = lab_command(command, state, lab.ip(index), f"{name}-{index}", config=config, extra=extra, peers=bootstrap)
    process = lab.run(index, argv, tmp_path / f"n{index}.out", env)

    def listening():
        assert process.poll() is None, (tmp_path / f"n{index}.out").read_text()[-3000:]
        path = state / "addresses.txt"
        return path.exists() and path.read_text().split()

    return wait_for(listening, 180, f"node {index} to listen", interval=0.5)[0]
