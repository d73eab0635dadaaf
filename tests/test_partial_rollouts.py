"""rollout.over_sample (partial rollouts, APRIL): a round samples groups for more questions than it trains, stops once
enough are complete, and resumes the completions it stopped in the next round, where they stopped, under the newer
policy; their older tokens keep their behaviour log-probs or are masked out of the policy-gradient term."""

from __future__ import annotations

import asyncio
import functools
import math

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from node.config import ConfigError, RolloutConfig, TrainerConfig
from node.loop import Node
from node.rollouts.base import Completion, PartialCompletion, RolloutBackend, RolloutGroup, TrainingBatch
from node.rollouts.partial import PartialRollouts
from node.rollouts.transformers_backend import TransformersBackend
from node.tasks import Question
from node.trainer import GRPOTrainer, completion_logprobs
from node.transport.null import NullTransport
from protocol.specs import TaskSpec

EOS, PAD = 1, 0


class NeverEnding(Qwen2ForCausalLM):
    """A tiny policy that never samples the end of sequence: a row ends only at its token budget, so which rows end
    when is known in advance."""

    @functools.wraps(Qwen2ForCausalLM.forward)  # the sampler reads the forward's signature (its cache keyword)
    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits[..., EOS] = -math.inf
        return out


class Characters:
    """The sampler's tokenizer as far as it uses one: ids decoded as letters."""

    eos_token_id, pad_token_id = EOS, PAD

    def encode(self, text, add_special_tokens=False):
        return [ord(c) - ord("a") for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(ord("a") + i) for i in ids)


@pytest.fixture
def policy():
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=16,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    return NeverEnding(config).eval()


def backend_for(model, **settings) -> TransformersBackend:
    return TransformersBackend(RolloutConfig(max_new_tokens=8, **settings), model, Characters(), policy_version=0)


def test_a_stopped_completion_resumes_where_it_stopped_with_what_it_has_off_its_budget(policy):
    backend = backend_for(policy)
    nearly_done = PartialCompletion([3, 4], [5] * 7, [-1.0] * 7, [0] * 7)  # one token of its budget left
    fresh = [PartialCompletion([6, 7]) for _ in range(3)]
    first = backend.sample_until([nearly_done, *fresh], group_of=[0, 1, 1, 1], groups_wanted=1, seed=3)
    # the first group ended at the first step; the round stopped there, the other's rows holding one token each
    assert isinstance(first[0], Completion) and len(first[0].completion_ids) == 8 and first[0].finish_reason == "length"
    assert first[0].completion_ids[:7] == [5] * 7 and first[0].logprobs[:7] == [-1.0] * 7
    with torch.no_grad():  # its new token sampled after its old ones, in the batch beside rows that had none
        scored, _ = completion_logprobs(policy, [(first[0].prompt_ids, first[0].completion_ids)], PAD, 1.0)
    assert scored[0, 7].item() == pytest.approx(first[0].logprobs[7], abs=1e-5)
    stopped = first[1:]
    assert all(isinstance(row, PartialCompletion) and len(row.completion_ids) == 1 for row in stopped)
    assert all(row.token_versions == [0] and row.prompt_ids == [6, 7] for row in stopped)

    backend.sync_weights(policy, 1)  # the next round's policy (the same weights here, so log-probs can be checked)
    resumed = backend.sample_until(stopped, group_of=[0, 0, 0], groups_wanted=1, seed=4)
    for before, after in zip(stopped, resumed):
        assert isinstance(after, Completion)
        assert after.completion_ids[:1] == before.completion_ids and after.logprobs[:1] == before.logprobs
        assert len(after.completion_ids) == 8  # max_new_tokens in all: the budget less what it had
        assert after.token_versions == [0] + [1] * 7 and after.policy_version == 0  # the oldest token's version
    # the resumed tokens' behaviour log-probs are the trainer's, as if sampled in one go
    with torch.no_grad():
        scored, _ = completion_logprobs(policy, [(r.prompt_ids, r.completion_ids) for r in resumed], PAD, 1.0)
    assert torch.allclose(scored, torch.tensor([r.logprobs for r in resumed]), atol=1e-5)


def test_sampling_until_every_group_is_done_samples_what_generate_samples(policy):
    backend = backend_for(policy)
    generated = [c for group in backend.generate(["cd", "e"], 3, seed=11) for c in group]
    rows = [PartialCompletion(list(c.prompt_ids)) for c in generated]
    sampled = backend.sample_until(rows, group_of=[0, 0, 0, 1, 1, 1], groups_wanted=2, seed=11)
    assert [(c.completion_ids, c.logprobs, c.token_versions) for c in sampled] == [
        (c.completion_ids, c.logprobs, None) for c in generated
    ]


class ScriptedTail(RolloutBackend):
    """A resumable backend whose tail the test sets: in each call, the rows of the groups past the first
    `groups_wanted` that have no token yet stop after one; every other row ends, every other one of them at the end
    of sequence (a reward spread with tasks.format_reward, so that rounds step)."""

    resumable = True

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.policy_version = 0
        self.calls: list[int] = []  # rows per call

    @classmethod
    def factory(cls):
        return lambda model, tokenizer, policy_version: cls(tokenizer)

    def sample_until(self, rows, group_of, groups_wanted, seed):
        self.calls.append(len(rows))
        out = []
        for i, (row, group) in enumerate(zip(rows, group_of)):
            versions = row.token_versions + [self.policy_version]
            if group >= groups_wanted and not row.completion_ids:
                out.append(PartialCompletion(row.prompt_ids, [5], [-0.5], versions))
                continue
            stops = i % 2 == 0
            ids = row.completion_ids + [6] + ([self.tokenizer.eos_token_id] if stops else [])
            versions += [self.policy_version] * (len(ids) - len(versions))
            out.append(
                Completion(
                    row.prompt_ids,
                    ids,
                    "7",  # an answer, right or wrong: the format bonus goes to the rows that stopped
                    row.logprobs + [-0.7, -0.1][: len(ids) - len(row.logprobs)],
                    "stop" if stops else "length",
                    min(versions),
                    versions,
                )
            )
        return out

    def generate(self, prompts, n, seed, greedy=False):
        raise AssertionError("a partial round samples through sample_until")

    def sync_weights(self, model, policy_version):
        self.policy_version = policy_version


class Published(NullTransport):
    def __init__(self):
        self.groups: list[RolloutGroup] = []

    async def publish(self, round_, policy_version, groups):
        self.groups += groups


def run(node: Node, rounds: int) -> list[dict]:
    async def scenario():
        return [await node.run_round() for _ in range(rounds)]

    return asyncio.run(scenario())


def test_a_round_publishes_and_trains_complete_groups_and_carries_the_rest(tiny_config, tmp_path):
    transport = Published()
    node = Node(
        tiny_config("rollout.over_sample=1.0", "eval_every=0", "tasks.format_reward=0.1"),
        transport=transport,
        rollout_backend=ScriptedTail.factory(),
    )
    node.load()
    rows = run(node, 3)
    # I = 2, G = 4: four groups sampled a round, two complete; the other two's 8 completions carried
    assert [row["carried_out"] for row in rows] == [8, 8, 8]
    assert [row["carried_in"] for row in rows] == [0, 8, 8]
    assert node.backend.calls == [16, 16, 16]  # the carried rows resumed beside 2 fresh groups (8 rows)
    # every group published has all its completions ended (the carried rows never leave the node unfinished)
    assert len(transport.groups) == 6 and all(len(g.completions) == 4 for g in transport.groups)
    assert all(isinstance(c, Completion) for g in transport.groups for c in g.completions)
    # from round 2 on the carried groups come first and are the ones completed, their first token of the round before
    versions = [0] + [row["policy_version"] for row in rows]
    assert versions[1] > 0 and versions[2] > versions[1]  # the rounds stepped: the carried tokens are older
    for k in (1, 2):
        resumed = [c for g in transport.groups[2 * k : 2 * k + 2] for c in g.completions]
        assert all(c.token_versions[0] == versions[k - 1] == c.policy_version for c in resumed)
        assert all(c.token_versions[-1] == versions[k] for c in resumed)
        # staleness: the policy that trained them less the version of their oldest token
        assert rows[k]["staleness_max"] == rows[k]["staleness_mean"] == versions[k] - versions[k - 1]
    assert rows[0]["staleness_max"] == 0


def test_keep_and_mask_mark_the_older_tokens_as_set():
    completed = Completion([3], [5, 6, 1], "", [-0.5, -0.7, -0.1], "stop", 2, [2, 3, 3])

    class Done(RolloutBackend):
        resumable = True

        def sample_until(self, rows, group_of, groups_wanted, seed):
            return [completed for _ in rows]

        def generate(self, prompts, n, seed, greedy=False):
            raise AssertionError

        def sync_weights(self, model, policy_version):
            pass

    question = Question(TaskSpec("x", {}, 0, 0), "q", "a", {})
    for prefix, masked in (("keep", 0), ("mask", 1)):
        partial = PartialRollouts(Done(), lambda text: [3], lambda q: q.text, 2, 0.5, prefix)
        [(_, completions)] = partial.sample([question], wanted=1, seed=0).groups
        assert [c.masked_prefix for c in completions] == [masked, masked]


def test_the_trainer_weighs_kept_older_tokens_and_leaves_masked_ones_out_hand_computed(policy):
    """A group of two: a resumed completion (its first token sampled by version 4, the rest by 5, as the trainer now
    is) and a fresh on-policy one, rewards 1 and 0, so advantages +a and -a (a = 0.5 / std([1, 0]) = 1/sqrt(2)). With
    one epoch pi_old is the policy itself (ratio 1), so each token adds -advantage * weight, the weight being
    min(cap, pi / pi_behaviour): exp(-0.3) for the older token whose sampler found it likelier by 0.3, 1 elsewhere."""
    prompt, ids = [3], [4, 5, 6]
    with torch.no_grad():
        current, _ = completion_logprobs(policy, [(prompt, ids)], PAD, 1.0)
    now = current[0].tolist()
    behaviour = [now[0] + 0.3, now[1], now[2]]
    a = 0.5 / math.sqrt(0.5)
    expected = {
        # policy-term sum over 6 tokens: -a * (e^-0.3 + 1 + 1) for the resumed one, +a * 3 for the fresh one
        "keep": (a * (1 - math.exp(-0.3)) / 6, (math.exp(-0.3) + 2) / 3),
        # its older token out: -a * 2 + a * 3 over 5 tokens, and only the two current-policy weights of 1
        "mask": (a / 5, 1.0),
    }
    for setting, (loss, weight_mean) in expected.items():
        trainer = GRPOTrainer(
            TrainerConfig(imitation_coef=0.0, advantage_eps=1e-12, max_grad_norm=1e9),
            policy,
            pad_id=PAD,
            temperature=1.0,
            policy_version=5,
        )
        resumed = Completion(prompt, ids, "", behaviour, "stop", 4, [4, 5, 5], masked_prefix=int(setting == "mask"))
        fresh = Completion(prompt, ids, "", now, "stop", 5)
        state = {k: v.clone() for k, v in policy.state_dict().items()}
        stats = trainer.step(TrainingBatch([RolloutGroup(TaskSpec("x", {}, 0, 0), [resumed, fresh], [1.0, 0.0])]))
        policy.load_state_dict(state)
        assert stats.tokens == (6 if setting == "keep" else 5)
        assert stats.loss == pytest.approx(loss, abs=1e-5)
        assert stats.importance_weight_mean == pytest.approx(weight_mean, abs=1e-5)


def test_off_the_round_is_the_one_before(tiny_config, tmp_path):
    node = Node(tiny_config("eval_every=0"), transport=NullTransport())
    node.load()
    assert node.partial is None and node.config.rollout.over_sample == 0
    [row] = run(node, 1)
    assert not {"carried_in", "carried_out", "staleness_mean"} & set(row)


@pytest.mark.parametrize(
    "sets, blocker",
    [
        (["rollout.backend=vllm"], "rollout.backend vllm"),
        (["rollout.max_staleness=1"], "rollout.max_staleness 1"),
        (["swarm.transport=dht", "swarm.external_questions=2", "swarm.external_gate=stronger_peer"], "external_gate"),
        (["swarm.transport=dht", "swarm.external_questions=2", "swarm.local_draw=balance"], "local_draw balance"),
        (["swarm.transport=dht", "pipeline.objective=grpo"], "pipeline.objective grpo"),
    ],
)
def test_partial_rollouts_are_refused_where_a_round_cannot_stop_and_resume(sets, blocker, tiny_config):
    with pytest.raises(ConfigError, match=f"rollout.over_sample 0.5 .*{blocker}"):
        tiny_config("rollout.over_sample=0.5", *sets)
