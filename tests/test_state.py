import asyncio
import json

import torch

from node.loop import Node
from node.files import append_json_line, atomic_write_text
from node.state import StateStore


def test_atomic_write_replaces_whole_file(tmp_path):
    path = tmp_path / "f.txt"
    atomic_write_text(path, "one")
    atomic_write_text(path, "two")
    assert path.read_text() == "two"
    assert [p.name for p in tmp_path.iterdir()] == ["f.txt"]  # no temp files left


def test_json_lines_append_whole_under_a_new_folder(tmp_path):
    path = tmp_path / "deep" / "results.jsonl"
    append_json_line(path, {"seed": 0, "pad": "x" * 70_000})
    append_json_line(path, {"seed": 1})
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["seed"] for r in rows] == [0, 1] and len(rows[0]["pad"]) == 70_000


def test_metrics_skip_cut_lines_and_truncate(tmp_path):
    store = StateStore(tmp_path)
    for i in range(1, 4):
        store.append_metrics({"round": i, "x": i})
    with open(store.metrics_path, "a") as handle:
        handle.write('{"round": 4, "x"')  # a kill mid-write
    assert [r["round"] for r in store.read_metrics()] == [1, 2, 3]
    store.truncate_metrics(2)
    assert [json.loads(line)["round"] for line in store.metrics_path.read_text().splitlines()] == [1, 2]


def test_interrupted_checkpoint_is_ignored(tiny_config, tmp_path):
    config = tiny_config()
    node = Node(config)
    node.load()
    asyncio.run(node.run(2, asyncio.Event()))
    store = node.store
    assert store.latest().name == "round-00000002"
    # a save killed before LATEST moved: a staging folder and a newer folder without LATEST
    (store.checkpoints / ".staging-x").mkdir()
    assert store.latest().name == "round-00000002"


def test_resume_restores_weights_optimizer_and_version(tiny_config, tmp_path):
    config = tiny_config()
    first = Node(config)
    first.load()
    asyncio.run(first.run(3, asyncio.Event()))
    weights = {k: v.clone() for k, v in first.model.state_dict().items()}
    optimizer_steps = [s["step"] for s in first.trainer.optimizer.state_dict()["state"].values()]

    second = Node(config)
    second.load()
    assert second.round == 3 and second.policy_version == first.policy_version
    assert all(torch.equal(weights[k], v) for k, v in second.model.state_dict().items())
    assert [s["step"] for s in second.trainer.optimizer.state_dict()["state"].values()] == optimizer_steps
    assert len(list(second.store.checkpoints.glob("round-*"))) == config.checkpoint_keep


def test_resume_replays_the_right_answers_the_node_kept_before_the_restart(tiny_config, tmp_path):
    """swarm.own_replay's answers, and where its draws stood, survive a restart with the checkpoint: the restarted node
    draws what the first would have drawn next."""
    from node.rollouts.base import Completion, RolloutGroup
    from protocol import TaskSpec

    config = tiny_config("swarm.own_replay=2", "swarm.imitation=own")
    first = Node(config)
    first.load()
    asyncio.run(first.run(1, asyncio.Event()))
    spec = TaskSpec("basic_arithmetic", {"min_terms": 2}, seed=3, index=7)
    right = [Completion([5, 6], [10 + k, 2], f"{k}", [-0.5, -0.1], "stop", policy_version=1) for k in range(4)]
    first.own_replay.add([RolloutGroup(spec, right, [1.0] * 4, correct=[True] * 4)])
    kept = list(first.own_replay.answers)
    first.own_replay.draw()  # moves the draws' generator off where a fresh node's starts
    first.save()

    second = Node(config)
    second.load()
    assert list(second.own_replay.answers) == kept  # every spec and completion field, in order
    assert second.own_replay.draw() == first.own_replay.draw()
    # without replay the checkpoint holds nothing of it, and a node that turns replay on later starts empty
    plain = tiny_config("swarm.own_replay=0", "swarm.imitation=own", state_dir=tmp_path / "plain")
    alone = Node(plain)
    alone.load()
    asyncio.run(alone.run(1, asyncio.Event()))
    assert alone.node_state() is None
    later = Node(tiny_config("swarm.own_replay=2", "swarm.imitation=own", state_dir=tmp_path / "plain"))
    later.load()
    assert list(later.own_replay.answers) == []
