"""A task mix of several specialties: each one named, and reported on its own in metrics,
`stats`, the heartbeat and the held-out evaluation."""

from __future__ import annotations

import asyncio
import json

import pytest

from node.telemetry import summarize_metrics
from node.config import ConfigError, TasksConfig
from node.loop import Node
from node.tasks import TaskSource
from tests.helpers.rollouts import ScriptedBackend
from tests.helpers.tasks import ARITHMETIC, MIX
from protocol import NodeIdentity, PeerStats, TaskSpec, decode_message, encode_message


def test_labels_name_each_entry_and_must_be_distinct():
    tasks = TasksConfig(datasets=MIX)
    source = TaskSource(tasks, seed=3)
    labels = {source.label(source.spec(draw)) for draw in range(60)}
    assert labels == {"add", "subtract", "chain_sum"}  # the label, or the dataset's name when none is given
    assert source.label(TaskSpec("gcd", {}, 1, 0)) == "gcd"  # a peer's question from outside our mix
    with pytest.raises(ValueError, match="distinct 'label'"):
        TasksConfig(datasets=[MIX[0], {**MIX[1], "label": "add"}])
    with pytest.raises(ValueError, match="distinct 'label'"):
        TasksConfig(datasets=[{"name": "basic_arithmetic"}, {"name": "basic_arithmetic", "config": ARITHMETIC}])


def test_a_bad_mix_is_refused_with_a_clear_error(tiny_config):
    with pytest.raises(ConfigError, match="distinct 'label'"):
        tiny_config(f"tasks.datasets={json.dumps([MIX[0], MIX[0]])}")


def test_each_specialty_is_reported_in_metrics_stats_and_the_heartbeat(tiny_config):
    config = tiny_config(
        f"tasks.datasets={json.dumps(MIX)}", "swarm.local_questions=6", "eval_every=2", "tasks.heldout_size=12"
    )
    node = Node(config)
    node.load()

    async def rounds():
        return [await node.run_round() for _ in range(2)]

    rows = asyncio.run(rounds())
    labels = {"add", "subtract", "chain_sum"}
    for row in rows:
        assert set(row["reward_by_dataset"]) <= labels and row["reward_by_dataset"]
        assert set(row["accuracy_by_dataset"]) == set(row["reward_by_dataset"])
        assert all(0.0 <= v <= 1.0 for v in row["accuracy_by_dataset"].values())
    first, by_dataset = rows[0]["heldout_accuracy"], rows[0]["heldout_by_dataset"]
    assert set(by_dataset) == {TaskSource(config.tasks, 0).label(q.spec) for q in node.evaluator.questions()}
    sizes = {
        label: sum(TaskSource(config.tasks, 0).label(q.spec) == label for q in node.evaluator.questions())
        for label in by_dataset
    }
    # the parts add up to the whole
    assert first == pytest.approx(sum(by_dataset[label] * sizes[label] for label in by_dataset) / 12)
    assert "heldout_by_dataset" in rows[1]  # eval_every=2: round 2 evaluates too

    summary = summarize_metrics(node.store.read_metrics())
    assert set(summary["by_dataset"]) == set(by_dataset) | {label for r in rows for label in r["reward_by_dataset"]}

    node.identity = NodeIdentity.generate()  # an isolated node has none; a swarm node's heartbeat is this same call
    heartbeat = node.peer_stats()
    assert heartbeat.accuracy_by_dataset and set(heartbeat.accuracy_by_dataset) <= labels
    wire = encode_message(heartbeat, identity=node.identity, swarm_id="s", seq=1, timestamp=heartbeat.last_seen)
    received = decode_message(wire, swarm_id="s", now=heartbeat.last_seen).message
    assert isinstance(received, PeerStats) and received.accuracy_by_dataset == heartbeat.accuracy_by_dataset


def one_right_or_none(signal_at: set[int]):
    """A script: question i of a round gets one right answer among wrong ones if i is in signal_at, else all wrong."""

    def script(backend: ScriptedBackend, prompts: list[str], call: int) -> list[list[str]]:
        n = 4  # tiny_config's rollout.completions_per_question
        return [
            [backend.right(p)] + [backend.wrong(p)] * (n - 1) if i in signal_at else [backend.wrong(p)] * n
            for i, p in enumerate(prompts)
        ]

    return script


def load_scripted(node: Node, questions: int) -> Node:
    node.load()
    node.backend.remember({node.tasks.prompt(q): q.answer for q in node.tasks.batch(first_draw=0, count=questions)})
    return node


@pytest.mark.parametrize("publish", ["all", "with_signal"])
def test_publish_with_signal_withholds_only_groups_whose_rewards_are_all_equal(tiny_config, publish):
    from node.transport.null import NullTransport

    published = []

    class Recording(NullTransport):
        async def publish(self, round_, policy_version, groups):
            published.append([(group.spec, group.rewards) for group in groups])

    # 2 local questions a round: the first with a right answer among wrong ones (a learning signal), the second all
    # wrong
    node = load_scripted(
        Node(
            tiny_config(f"swarm.publish={publish}"),
            transport=Recording(),
            rollout_backend=ScriptedBackend.factory(one_right_or_none({0})),
        ),
        2,
    )
    asyncio.run(node.run_round())
    [batch] = published
    assert [rewards for _, rewards in batch] == (
        [[1.0, 0.0, 0.0, 0.0], [0.0] * 4] if publish == "all" else [[1.0, 0.0, 0.0, 0.0]]
    )
    assert [spec.index for spec, _ in batch] == ([0, 1] if publish == "all" else [0])


def test_a_node_that_generates_more_than_it_trains_on_publishes_all_and_trains_on_those_with_a_signal(tiny_config):
    """SAPO at equal compute: a 4/4 node generates (and publishes) what an 8/0 node does, and trains on
    I of its own groups, those whose rewards differ first."""
    from node.transport.null import NullTransport

    published = []

    class Recording(NullTransport):
        async def publish(self, round_, policy_version, groups):
            published.append([group.spec.index for group in groups])

    # trains on swarm.local_questions=2 of the 4 it generates; questions 1 and 3 of each round carry a signal
    node = load_scripted(
        Node(
            tiny_config("swarm.generated_questions=4"),
            transport=Recording(),
            rollout_backend=ScriptedBackend.factory(one_right_or_none({1, 3})),
        ),
        8,
    )
    rows = [asyncio.run(node.run_round()) for _ in range(2)]
    assert published == [[0, 1, 2, 3], [4, 5, 6, 7]]  # the next round draws the next 4 questions of the stream
    # the two with a signal, none without
    assert [(row["groups_used"], row["groups_dropped"]) for row in rows] == [
        (2, 0),
        (2, 0),
    ]

    with pytest.raises(ConfigError, match="generated_questions"):
        tiny_config("swarm.generated_questions=1")  # fewer than the 2 it trains on
    assert tiny_config().swarm.generated_questions is None  # default: generate what it trains on


def test_a_specialist_warm_start_teaches_only_its_labels_and_is_cached_apart(tiny_config, monkeypatch):
    import node.warmstart
    from node.model import build_char_tokenizer, build_default_model, default_model_key

    drawn: list[str] = []

    class Recording(TaskSource):
        def batch(self, first_draw, count):
            questions = super().batch(first_draw, count)
            drawn.extend(self.label(q.spec) for q in questions)
            return questions

    monkeypatch.setattr(node.warmstart, "TaskSource", Recording)
    mix = f"tasks.datasets={json.dumps(MIX)}"
    specialist = tiny_config(mix, 'model.default.warmup_labels=["add", "chain_sum"]', "model.default.warmup_steps=6")
    tokenizer = build_char_tokenizer()
    model = build_default_model(specialist.model, len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id)
    node.warmstart.warm_start(model, tokenizer, specialist, progress=False)
    assert len(drawn) == 6 * specialist.model.default.warmup_batch_size and set(drawn) == {"add", "chain_sum"}

    generalist = tiny_config(mix, "model.default.warmup_steps=6")
    assert default_model_key(specialist) != default_model_key(generalist)  # two warm starts, two cached models
    with pytest.raises(ConfigError, match="not specialties of the task mix"):
        tiny_config(mix, 'model.default.warmup_labels=["multiply"]')
