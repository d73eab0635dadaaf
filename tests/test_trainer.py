import copy
import math

import pytest
import torch

from node.config import TrainerConfig
from node.rollouts.base import Completion
from node.trainer import GRPOTrainer, RolloutGroup, completion_logprobs, group_advantages, policy_loss
from protocol.specs import TaskSpec


def test_group_advantages_hand_computed():
    # mean 0.5, sample std sqrt(1/3) = 0.57735
    advantages = group_advantages([1.0, 0.0, 1.0, 0.0], eps=0.0)
    assert advantages == pytest.approx([0.866025, -0.866025, 0.866025, -0.866025], rel=1e-5)
    assert group_advantages([1.0, 0.0, 0.0, 0.0], eps=0.0) == pytest.approx([1.5, -0.5, -0.5, -0.5])
    assert group_advantages([0.3, 0.3], eps=1e-4) == [0.0, 0.0]


def test_policy_loss_clipping_hand_computed():
    logprobs = torch.log(torch.tensor([[1.5, 0.5, 1.0]]))  # ratios 1.5, 0.5, 1.0 against old = 0
    old = torch.zeros(1, 3)
    mask = torch.tensor([[True, True, True]])
    # A = +1: min(1.5, 1.28) = 1.28; min(0.5, 0.8) = 0.5; 1.0 -> loss = -(1.28 + 0.5 + 1.0)
    loss, info = policy_loss(logprobs, old, torch.tensor([1.0]), mask, 0.2, 0.28)
    assert loss.item() == pytest.approx(-(1.28 + 0.5 + 1.0))
    assert info["clipped_tokens"].item() == 2
    # A = -1: -min(-1.5, -1.28) = 1.5; -min(-0.5, -0.8) = 0.8; 1.0
    loss, _ = policy_loss(logprobs, old, torch.tensor([-1.0]), mask, 0.2, 0.28)
    assert loss.item() == pytest.approx(1.5 + 0.8 + 1.0)
    # masked tokens and importance weights
    loss, _ = policy_loss(
        logprobs,
        old,
        torch.tensor([1.0]),
        torch.tensor([[True, False, True]]),
        0.2,
        0.28,
        torch.tensor([[0.5, 9.0, 2.0]]),
    )
    assert loss.item() == pytest.approx(-(1.28 * 0.5 + 1.0 * 2.0))


def test_policy_loss_kl_term():
    logprobs = torch.log(torch.tensor([[0.5]]))
    ref = torch.log(torch.tensor([[0.25]]))
    loss, info = policy_loss(
        logprobs, logprobs.clone(), torch.tensor([0.0]), torch.tensor([[True]]), 0.2, 0.28, None, ref, kl_beta=0.1
    )
    expected_kl = 0.5 - math.log(0.5) - 1  # exp(ref - logp) - (ref - logp) - 1
    assert info["kl_sum"].item() == pytest.approx(expected_kl)
    assert loss.item() == pytest.approx(0.1 * expected_kl)


def test_policy_loss_kl_only_on_the_rows_named():
    logprobs = torch.log(torch.tensor([[0.5], [0.5]]))
    ref = torch.log(torch.tensor([[0.25], [0.125]]))
    mask = torch.tensor([[True], [True]])
    loss, info = policy_loss(
        logprobs, logprobs.clone(), torch.zeros(2), mask, 0.2, 0.28, None, ref, 0.1, torch.tensor([False, True])
    )
    expected_kl = 0.25 - math.log(0.25) - 1  # the second row's only: exp(ref - logp) - (ref - logp) - 1
    assert info["kl_sum"].item() == pytest.approx(expected_kl)
    assert loss.item() == pytest.approx(0.1 * expected_kl)


@pytest.fixture
def tiny_policy():
    from transformers import Qwen2Config, Qwen2ForCausalLM

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
    return Qwen2ForCausalLM(config).eval()


def _completion(prompt, ids, version=0, logprobs=None):
    return Completion(
        prompt_ids=prompt, completion_ids=ids, text="", logprobs=logprobs, finish_reason="stop", policy_version=version
    )


def test_padding_does_not_change_logprobs(tiny_policy):
    rows = [([3, 4, 5, 6, 7], [8, 9]), ([3], [8, 9, 10, 11])]
    together, mask = completion_logprobs(tiny_policy, rows, pad_id=0, temperature=1.0)
    for i, row in enumerate(rows):
        alone, _ = completion_logprobs(tiny_policy, [row], pad_id=0, temperature=1.0)
        assert torch.allclose(together[i, : len(row[1])], alone[0, : len(row[1])], atol=1e-5)
    assert mask.sum().item() == 6


def test_step_raises_logprobs_of_positive_advantage_completions(tiny_policy):
    prompt = [3, 4, 5]
    good, bad = [8, 9, 1], [10, 11, 1]
    with torch.no_grad():
        before, _ = completion_logprobs(tiny_policy, [(prompt, good), (prompt, bad)], 0, 1.0)
    completions = [
        _completion(prompt, good, logprobs=before[0].tolist()),
        _completion(prompt, bad, logprobs=before[1].tolist()),
    ]
    trainer = GRPOTrainer(TrainerConfig(lr=1e-2), tiny_policy, pad_id=0, temperature=1.0)
    stats = trainer.step([RolloutGroup(TaskSpec("x", {}, 0, 0), completions, rewards=[1.0, 0.0])])
    assert stats.stepped and trainer.policy_version == 1 and stats.tokens == 6
    with torch.no_grad():
        after, _ = completion_logprobs(tiny_policy, [(prompt, good), (prompt, bad)], 0, 1.0)
    assert after[0].sum() > before[0].sum()
    assert after[1].sum() < before[1].sum()


def test_uniform_and_empty_groups_do_not_step(tiny_policy):
    weights = [p.detach().clone() for p in tiny_policy.parameters()]
    trainer = GRPOTrainer(TrainerConfig(), tiny_policy, pad_id=0, temperature=1.0)
    uniform = RolloutGroup(TaskSpec("x", {}, 0, 0), [_completion([3], [4]), _completion([3], [5])], [1.0, 1.0])
    empty = RolloutGroup(TaskSpec("x", {}, 0, 1), [_completion([3], []), _completion([3], [])], [1.0, 0.0])
    stats = trainer.step([uniform, empty])
    assert not stats.stepped and stats.groups_dropped == 1 and trainer.policy_version == 0
    assert all(torch.equal(a, b) for a, b in zip(weights, tiny_policy.parameters()))
    assert all(torch.isfinite(p).all() for p in tiny_policy.parameters())


def test_micro_batching_gives_the_same_gradient(tiny_policy):
    import copy

    groups = [
        RolloutGroup(
            TaskSpec("x", {}, 0, i),
            [_completion([3, i + 4], [5, 6, 1][: i + 1]), _completion([3], [7, 1])],
            [float(i % 2), 1.0 - i % 2],
        )
        for i in range(3)
    ]
    results = []
    for micro in (1, 64):
        model = copy.deepcopy(tiny_policy)
        trainer = GRPOTrainer(TrainerConfig(micro_batch_size=micro, lr=1e-3), model, pad_id=0, temperature=1.0)
        trainer.step(groups)
        results.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert torch.allclose(results[0], results[1], atol=1e-6)


def test_off_policy_samples_get_a_truncated_importance_weight(tiny_policy):
    trainer = GRPOTrainer(TrainerConfig(importance_cap=2.0), tiny_policy, pad_id=0, temperature=1.0, policy_version=5)
    with torch.no_grad():
        current, _ = completion_logprobs(tiny_policy, [([3], [4, 5])], 0, 1.0)
    # behaviour much less likely than now -> weight capped at 2; much more likely -> weight < 1
    stale_low = _completion([3], [4, 5], version=1, logprobs=(current[0] - 5.0).tolist())
    stale_high = _completion([3], [4, 5], version=1, logprobs=(current[0] + 0.5).tolist())
    rows = trainer.training_rows([RolloutGroup(TaskSpec("x", {}, 0, 0), [stale_low, stale_high], [1.0, 0.0])])
    old, weights, positions = trainer.frozen_logprobs(rows)
    assert positions == 1 + 2 + 2  # its own no-grad forward: the shared prompt once, then both completions
    assert torch.allclose(old[0], current[0], atol=1e-6)
    assert torch.allclose(weights[0], torch.full((2,), 2.0))
    assert torch.allclose(weights[1], torch.full((2,), math.exp(-0.5)), atol=1e-5)


def test_step_reports_the_mean_importance_weight_of_off_policy_tokens(tiny_policy):
    trainer = GRPOTrainer(TrainerConfig(importance_cap=2.0), tiny_policy, pad_id=0, temperature=1.0, policy_version=5)
    with torch.no_grad():
        current, _ = completion_logprobs(tiny_policy, [([3], [4, 5])], 0, 1.0)
    on_policy = _completion([3], [4, 5], version=5, logprobs=current[0].tolist())
    assert (
        trainer.step([RolloutGroup(TaskSpec("x", {}, 0, 0), [on_policy, on_policy], [1.0, 0.0])]).importance_weight_mean
        is None
    )
    with torch.no_grad():  # the first step moved the policy: take the behaviour log-probs from where it is now
        current, _ = completion_logprobs(tiny_policy, [([3], [4, 5])], 0, 1.0)
    trainer.policy_version = 5
    on_policy = _completion([3], [4, 5], version=5, logprobs=current[0].tolist())
    stale_high = _completion([3], [4, 5], version=1, logprobs=(current[0] + 0.5).tolist())
    stats = trainer.step([RolloutGroup(TaskSpec("x", {}, 0, 0), [on_policy, stale_high], [1.0, 0.0])])
    # only the off-policy sample's two tokens count
    assert stats.importance_weight_mean == pytest.approx(math.exp(-0.5), abs=1e-4)


def test_capability_aware_baseline_hand_computed():
    # A peer right 6 times in 8 (mean 0.75, sample std 0.46291) where this node is right once in 10:
    # omega = 0.1 / 0.75, baseline = 0.1: right answers (1 - 0.1) / 0.46291, wrong ones -0.1 / 0.46291
    rewards = [1.0] * 6 + [0.0] * 2
    scaled = group_advantages(rewards, eps=0.0, baseline_scale=0.1 / 0.75)
    assert scaled == pytest.approx([1.944222] * 6 + [-0.216025] * 2, rel=1e-5)
    # omega = 1: plain GRPO
    assert group_advantages(rewards, eps=0.0) == pytest.approx([0.540062] * 6 + [-1.620185] * 2, rel=1e-5)
    assert group_advantages([1.0, 1.0], eps=1e-4, baseline_scale=0.2) == [0.0, 0.0]  # no signal is invented
    # a scaled baseline at or above the best reward would push right answers down: the plain mean instead
    assert group_advantages(rewards, eps=0.0, baseline_scale=2.0) == pytest.approx(group_advantages(rewards, eps=0.0))


def test_sequence_importance_weight_is_exponential_and_never_above_one(tiny_policy):
    trainer = GRPOTrainer(
        TrainerConfig(importance_level="sequence", importance_alpha=1.0),
        tiny_policy,
        pad_id=0,
        temperature=1.0,
        policy_version=5,
    )
    with torch.no_grad():
        current, _ = completion_logprobs(tiny_policy, [([3], [4, 5])], 0, 1.0)
    likelier_before = _completion([3], [4, 5], version=-1, logprobs=(current[0] + 0.5).tolist())  # s = exp(-0.5)
    # s = exp(5), capped at 1
    unlikely_before = _completion([3], [4, 5], version=-1, logprobs=(current[0] - 5.0).tolist())
    rows = trainer.training_rows(
        [RolloutGroup(TaskSpec("x", {}, 0, 0), [likelier_before, unlikely_before], [1.0, 0.0])]
    )
    _, weights, _ = trainer.frozen_logprobs(rows)
    # s * s^alpha, one value for the whole sequence
    assert torch.allclose(weights[0], torch.full((2,), math.exp(-1.0)), atol=1e-5)
    assert torch.allclose(weights[1], torch.ones(2))


def test_a_groups_loss_scale_multiplies_its_loss(tiny_policy):
    import copy

    losses = []
    for scale in (1.0, 3.0):
        model = copy.deepcopy(tiny_policy)
        trainer = GRPOTrainer(TrainerConfig(), model, pad_id=0, temperature=1.0, policy_version=5)
        # completions of different lengths: the token-level mean of the advantages is not zero
        group = RolloutGroup(
            TaskSpec("x", {}, 0, 0),
            [_completion([3], [4]), _completion([3], [5, 6, 7])],
            [1.0, 0.0],
            source="peer",
            loss_scale=scale,
        )
        losses.append(trainer.step([group]).loss)
    assert losses[0] != 0.0 and losses[1] == pytest.approx(3.0 * losses[0], rel=1e-5)


def _demonstration_group(completions: list[Completion], correct: list[bool], weight: float) -> RolloutGroup:
    return RolloutGroup(
        TaskSpec("x", {}, 0, 0),
        completions,
        rewards=[1.0] * len(completions),
        source="peer",
        correct=correct,
        imitation_weight=weight,
    )


def test_demonstrations_are_the_distinct_right_answers_of_a_weighted_group():
    right, again, wrong = _completion([3], [4, 1]), _completion([3], [4, 1]), _completion([3], [5, 1])
    group = _demonstration_group([right, again, wrong], [True, True, False], weight=0.5)
    assert group.demonstrations() == [right]  # the same tokens twice teach nothing twice; a wrong answer never
    assert _demonstration_group([right, wrong], [True, False], weight=0.0).demonstrations() == []
    # no verdicts: nothing
    assert RolloutGroup(TaskSpec("x", {}, 0, 0), [right], [1.0], imitation_weight=1.0).demonstrations() == []


def test_the_imitation_term_learns_demonstrations_the_policy_term_drops(tiny_policy):
    """A group whose answers are all right has no reward spread: GRPO drops it, the imitation term learns it."""
    prompt, answer = [3, 4], [8, 9, 1]
    with torch.no_grad():
        before, _ = completion_logprobs(tiny_policy, [(prompt, answer)], 0, 1.0)
    trainer = GRPOTrainer(TrainerConfig(lr=1e-2, imitation_coef=1.0), tiny_policy, pad_id=0, temperature=1.0)
    stats = trainer.step([_demonstration_group([_completion(prompt, answer)] * 2, [True, True], weight=1.0)])
    assert (
        stats.groups_dropped == 1
        and stats.tokens == 0
        and stats.imitation_sequences == 1
        and stats.stepped
        and trainer.policy_version == 1
    )
    assert stats.imitation_nll == pytest.approx(-before[0].mean().item(), rel=1e-4)
    with torch.no_grad():
        after, _ = completion_logprobs(tiny_policy, [(prompt, answer)], 0, 1.0)
    assert after[0].sum() > before[0].sum() + 0.1


def test_the_imitation_term_hand_computed_weighted_and_bounded(tiny_policy):
    import copy

    prompt = [3]
    good, bad, demo = [4, 1], [5, 1], [6, 7, 1]
    policy_group = RolloutGroup(
        TaskSpec("x", {}, 0, 0), [_completion(prompt, good), _completion(prompt, bad)], [1.0, 0.0]
    )
    with torch.no_grad():
        before, _ = completion_logprobs(tiny_policy, [(prompt, good), (prompt, bad), (prompt, demo)], 0, 1.0)

    def gradient(
        coef: float, groups: list[RolloutGroup], demonstration_groups: list[RolloutGroup] = ()
    ) -> torch.Tensor:
        model = copy.deepcopy(tiny_policy)
        GRPOTrainer(TrainerConfig(imitation_coef=coef, max_grad_norm=1e9), model, pad_id=0, temperature=1.0).step(
            groups, demonstration_groups
        )
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    def loss_gradient(loss_of) -> torch.Tensor:
        model = copy.deepcopy(tiny_policy)
        logprobs, _ = completion_logprobs(model, [(prompt, good), (prompt, bad), (prompt, demo)], 0, 1.0)
        loss_of(logprobs).backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    # by hand: the policy term over 4 tokens (A = +-0.5 / (sqrt(0.5) + eps)) plus 2 x 0.5 x NLL of the 3-token
    # demonstration / 3
    advantage = 0.5 / (math.sqrt(0.5) + TrainerConfig().advantage_eps)
    expected = loss_gradient(
        lambda lp: (-advantage * lp[0, :2].sum() + advantage * lp[1, :2].sum()) / 4 + 2.0 * 0.5 * -lp[2, :3].sum() / 3
    )
    demonstration = _demonstration_group([_completion(prompt, demo)], [True], weight=0.5)
    assert torch.allclose(gradient(2.0, [policy_group, demonstration]), expected, atol=1e-5)
    # a group given as demonstrations only: its reward spread stays out of the policy term, its right answer is learned
    peer = RolloutGroup(
        TaskSpec("x", {}, 0, 0),
        [_completion(prompt, demo), _completion(prompt, bad)],
        [1.0, 0.0],
        correct=[True, False],
        imitation_weight=0.5,
    )
    assert torch.allclose(gradient(2.0, [policy_group], [peer]), expected, atol=1e-5)
    # off: demonstrations ignored
    assert torch.allclose(gradient(0.0, [policy_group, demonstration]), gradient(0.0, [policy_group]))

    plain = GRPOTrainer(TrainerConfig(imitation_coef=0.0), copy.deepcopy(tiny_policy), pad_id=0, temperature=1.0)
    assert not plain.step([_demonstration_group([_completion(prompt, demo)], [True], weight=1.0)]).stepped
    many = [_demonstration_group([_completion(prompt, [4 + i, 1])], [True], weight=0.1 * (i + 1)) for i in range(6)]
    capped = GRPOTrainer(
        TrainerConfig(imitation_coef=1.0, imitation_max_sequences=4),
        copy.deepcopy(tiny_policy),
        pad_id=0,
        temperature=1.0,
    )
    assert capped.step(many).imitation_sequences == 4  # the four heaviest


def _flat_grad(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def test_one_epoch_takes_pi_old_from_the_training_forward(tiny_policy):
    """With one epoch a round the policy has not moved when the loss is taken: pi_old of a peer's sample is the training
    forward, detached. Same gradient as a separate no-grad pass, and no such pass is run."""
    import copy

    prompt = [3]
    with torch.no_grad():
        current, _ = completion_logprobs(tiny_policy, [(prompt, [4, 1]), (prompt, [5, 1])], 0, 1.0)
    # a peer's group: behaviour log-probs 0.3 above ours on the first, 0.2 below on the second (weights e^-0.3, e^0.2)
    peer = RolloutGroup(
        TaskSpec("x", {}, 0, 0),
        [
            _completion(prompt, [4, 1], version=-1, logprobs=(current[0] + 0.3).tolist()),
            _completion(prompt, [5, 1], version=-1, logprobs=(current[1] - 0.2).tolist()),
        ],
        [1.0, 0.0],
        source="peer",
    )
    model = copy.deepcopy(tiny_policy)
    trainer = GRPOTrainer(TrainerConfig(max_grad_norm=1e9), model, pad_id=0, temperature=1.0, policy_version=5)
    stats = trainer.step([peer])
    assert stats.forward_tokens == 0 and stats.train_tokens == 1 + 2 + 2  # the shared prompt once, then each answer
    assert stats.train_calls == 1  # both answers in one micro-batch
    # by hand: ratio 1 (its gradient that of log pi), A = +-0.5 / (sqrt(0.5) + eps), weights min(2, pi / pi_behaviour)
    advantage = 0.5 / (math.sqrt(0.5) + TrainerConfig().advantage_eps)
    reference = copy.deepcopy(tiny_policy)
    logprobs, _ = completion_logprobs(reference, [(prompt, [4, 1]), (prompt, [5, 1])], 0, 1.0)
    (-advantage * math.exp(-0.3) * logprobs[0].sum() + advantage * math.exp(0.2) * logprobs[1].sum()).div(4).backward()
    assert torch.allclose(_flat_grad(model), _flat_grad(reference), atol=1e-5)
    assert stats.importance_weight_mean == pytest.approx((math.exp(-0.3) + math.exp(0.2)) / 2, abs=1e-4)
    # two epochs: pi_old must stay where the round began, so it is computed first, by a no-grad pass of its own
    two = GRPOTrainer(TrainerConfig(epochs_per_round=2), copy.deepcopy(tiny_policy), 0, 1.0, policy_version=5)
    two_epochs = two.step([peer])
    assert two_epochs.forward_tokens == 1 + 2 + 2
    assert two_epochs.train_calls == 2  # one micro-batch, each epoch
    # a micro-batch a row: a call each, and each row carries its prompt again
    single = GRPOTrainer(TrainerConfig(micro_batch_size=1), copy.deepcopy(tiny_policy), 0, 1.0, policy_version=5)
    one_by_one = single.step([peer])
    assert (one_by_one.train_calls, one_by_one.train_tokens) == (2, (1 + 2) + (1 + 2))


def test_a_demonstration_in_the_batch_shares_its_forward(tiny_policy):
    """A right answer that is both a policy-term completion and a demonstration: one row, both terms, one forward."""
    import copy

    prompt, good, bad = [3], [4, 1], [5, 6, 1]
    group = RolloutGroup(
        TaskSpec("x", {}, 0, 0),
        [_completion(prompt, good), _completion(prompt, bad)],
        [1.0, 0.0],
        correct=[True, False],
        imitation_weight=0.5,
    )
    model = copy.deepcopy(tiny_policy)
    trainer = GRPOTrainer(TrainerConfig(imitation_coef=2.0, max_grad_norm=1e9), model, 0, 1.0)
    stats = trainer.step([group])
    assert stats.train_tokens == 1 + 2 + 3 and stats.forward_tokens == 0 and stats.imitation_sequences == 1
    # off-policy rows (no behaviour log-probs): ratio 1; policy term over 5 tokens; imitation 2 x 0.5 x NLL(good) / 2
    advantage = 0.5 / (math.sqrt(0.5) + TrainerConfig().advantage_eps)
    reference = copy.deepcopy(tiny_policy)
    logprobs, _ = completion_logprobs(reference, [(prompt, good), (prompt, bad)], 0, 1.0)
    policy = (-advantage * logprobs[0, :2].sum() + advantage * logprobs[1, :3].sum()) / 5
    (policy + 2.0 * 0.5 * -logprobs[0, :2].sum() / 2).backward()
    assert torch.allclose(_flat_grad(model), _flat_grad(reference), atol=1e-5)


def test_chord_token_weight_spares_what_the_policy_holds(tiny_policy):
    import copy

    prompt, demo = [3], [6, 7, 1]
    group = RolloutGroup(
        TaskSpec("x", {}, 0, 0), [_completion(prompt, demo)], [1.0], correct=[True], imitation_weight=1.0
    )
    model = copy.deepcopy(tiny_policy)
    config = TrainerConfig(imitation_coef=1.0, imitation_token_weight="p_one_minus_p", max_grad_norm=1e9)
    GRPOTrainer(config, model, 0, 1.0).step([group])
    reference = copy.deepcopy(tiny_policy)
    logprobs, _ = completion_logprobs(reference, [(prompt, demo)], 0, 1.0)
    p = logprobs.detach().exp()[0, :3]
    (-(p * (1 - p) * logprobs[0, :3]).sum() / 3).backward()
    assert torch.allclose(_flat_grad(model), _flat_grad(reference), atol=1e-6)


def test_the_imitation_coefficient_decays_linearly_then_holds(tiny_policy):
    config = TrainerConfig(imitation_coef=4.0, imitation_coef_final=1.0, imitation_decay_updates=100)
    trainer = GRPOTrainer(config, tiny_policy, 0, 1.0)
    for version, expected in ((0, 4.0), (50, 2.5), (100, 1.0), (400, 1.0)):
        trainer.policy_version = version
        assert trainer.imitation_coef_now() == pytest.approx(expected)
    assert GRPOTrainer(TrainerConfig(imitation_coef=3.0), tiny_policy, 0, 1.0).imitation_coef_now() == 3.0


def test_distillation_hand_computed_and_a_group_all_wrong_still_taught(tiny_policy):
    """The distillation term: the sum over the taught completions' positions of KL(pi || pi_teacher) over the whole
    vocabulary, divided by their token count; a group with no reward spread, which GRPO drops, is still taught."""
    import copy

    from node.trainer import completion_distributions

    torch.manual_seed(1)
    teacher = copy.deepcopy(tiny_policy)
    with torch.no_grad():
        for p in teacher.parameters():
            p.add_(0.05 * torch.randn_like(p))
    prompt, good, bad = [3], [4, 1], [5, 6, 1]
    spread = RolloutGroup(
        TaskSpec("x", {}, 0, 0), [_completion(prompt, good), _completion(prompt, bad)], [1.0, 0.0], teacher=teacher
    )
    all_wrong = RolloutGroup(TaskSpec("x", {}, 0, 0), [_completion(prompt, bad)] * 2, [0.0, 0.0], teacher=teacher)
    pairs = [(prompt, good), (prompt, bad), (prompt, bad), (prompt, bad)]
    with torch.no_grad():
        _, teacher_dist, mask = completion_distributions(teacher, pairs, 0, 1.0)

    def gradient(config: TrainerConfig, groups) -> tuple[torch.Tensor, object]:
        model = copy.deepcopy(tiny_policy)
        stats = GRPOTrainer(config, model, pad_id=0, temperature=1.0).step(groups)
        return _flat_grad(model), stats

    def by_hand(loss_of) -> torch.Tensor:
        model = copy.deepcopy(tiny_policy)
        logprobs, dist, _ = completion_distributions(model, pairs, 0, 1.0)
        loss_of(logprobs, dist).backward()
        return _flat_grad(model)

    def kl(dist):  # per position, summed over the vocabulary, masked
        return ((dist.exp() * (dist - teacher_dist)).sum(-1) * mask).sum()

    advantage = 0.5 / (math.sqrt(0.5) + TrainerConfig().advantage_eps)
    config = TrainerConfig(imitation_coef=0.0, distill_coef=2.0, max_grad_norm=1e9)
    got, stats = gradient(config, [spread, all_wrong])
    # policy term on the spread group (5 tokens); distillation over all four completions (2 + 3 + 3 + 3 = 11 tokens)
    expected = by_hand(
        lambda lp, dist: (-advantage * lp[0, :2].sum() + advantage * lp[1, :3].sum()) / 5 + 2.0 * kl(dist) / 11
    )
    assert torch.allclose(got, expected, atol=1e-5)
    assert stats.distilled_sequences == 4 and stats.groups_dropped == 1
    with torch.no_grad():
        _, student_dist, _ = completion_distributions(tiny_policy, pairs, 0, 1.0)
    assert stats.distill_kl == pytest.approx(kl(student_dist).item() / 11, rel=1e-4)
    # a teacher's forward is no-grad work: counted
    assert stats.forward_tokens > 0
    # off: no teacher's term, the all-wrong group gives nothing
    off, off_stats = gradient(TrainerConfig(imitation_coef=0.0, max_grad_norm=1e9), [spread, all_wrong])
    assert off_stats.distilled_sequences == 0
    assert torch.allclose(
        off, by_hand(lambda lp, dist: (-advantage * lp[0, :2].sum() + advantage * lp[1, :3].sum()) / 5), atol=1e-6
    )
    # the all-wrong group alone is a step: the teacher still has something to say
    alone, alone_stats = gradient(config, [all_wrong])
    assert alone_stats.stepped and alone_stats.tokens == 0 and alone.abs().sum() > 0


def test_teachers_mark_the_groups_of_specialties_a_stronger_peer_offers():
    from node.teachers import Teachers

    accuracy = {"add": 0.9, "subtract": 0.1}
    teachers = Teachers(accuracy, label_of=lambda spec: spec.dataset)
    adder, subtracter, better = object(), object(), object()
    teachers.offer("add", "peer-a", adder, 0.6)  # weaker than this node at add
    teachers.offer("subtract", "peer-b", subtracter, 0.5)
    teachers.offer("subtract", "peer-c", object(), 0.4)  # weaker than the one offered: ignored
    groups = [RolloutGroup(TaskSpec(label, {}, 0, 0), [], []) for label in ("add", "subtract", "multiply")]
    assert teachers.assign(groups) == 1
    assert [g.teacher for g in groups] == [None, subtracter, None]
    teachers.offer("subtract", "peer-d", better, 0.7)  # stronger: replaces
    teachers.offer("multiply", "peer-e", adder, 0.45)  # a specialty never answered: the prior 0.5 is not beaten
    teachers.assign(groups)
    assert [g.teacher for g in groups] == [None, better, None]
    accuracy["subtract"] = 0.8  # the node caught up: no teacher any more
    teachers.assign(groups)
    assert groups[1].teacher is None


def test_project_conflicts_hand_computed():
    from node.trainer import project_conflicts

    # conflicting (dot -1): [1,0] loses its part along [-1,1] -> [0.5,0.5]; [-1,1] its part along [1,0] -> [0,1]
    total = project_conflicts([torch.tensor([1.0, 0.0]), torch.tensor([-1.0, 1.0])])
    assert total.tolist() == pytest.approx([0.5, 1.5])
    # no conflict (dot +1): summed unchanged
    assert project_conflicts([torch.tensor([1.0, 0.0]), torch.tensor([1.0, 1.0])]).tolist() == pytest.approx([2, 1])
    # exactly opposed: nothing of either is left
    assert project_conflicts([torch.tensor([2.0, 0.0]), torch.tensor([-1.0, 0.0])]).tolist() == pytest.approx([0, 0])


def _specialty_groups() -> tuple[RolloutGroup, RolloutGroup]:
    """Two specialties (one dataset, two configurations), with more completion tokens in the first."""
    first = RolloutGroup(
        TaskSpec("x", {"op": "+"}, 0, 0),
        [_completion([3, 4], [5, 6, 7, 1]), _completion([3, 4], [8, 9, 10, 1])],
        [1.0, 0.0],
    )
    second = RolloutGroup(
        TaskSpec("x", {"op": "-"}, 0, 1), [_completion([3, 4], [8, 1]), _completion([3, 4], [5, 1])], [1.0, 0.0]
    )
    return first, second


def _sgd_gradient(tiny_policy, weighting: str, groups: list[RolloutGroup]) -> torch.Tensor:
    """The update's gradient, read off a plain SGD step of rate 1 without clipping."""
    import copy

    model = copy.deepcopy(tiny_policy)
    config = TrainerConfig(specialty_weighting=weighting, max_grad_norm=1e9)
    trainer = GRPOTrainer(config, model, pad_id=0, temperature=1.0)
    trainer.optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    before = torch.cat([p.detach().flatten() for p in model.parameters()])
    trainer.step(groups)
    return before - torch.cat([p.detach().flatten() for p in model.parameters()])


def test_specialty_weighting_equal_and_projected_hand_computed(tiny_policy):
    from node.trainer import project_conflicts

    first, second = _specialty_groups()
    g_first = _sgd_gradient(tiny_policy, "tokens", [first])
    g_second = _sgd_gradient(tiny_policy, "tokens", [second])
    assert torch.dot(g_first, g_second) < 0  # the two specialties pull against each other here
    # tokens: each token weighs the same, so the specialty with 8 completion tokens outweighs the one with 4
    pooled = _sgd_gradient(tiny_policy, "tokens", [first, second])
    assert torch.allclose(pooled, (8 * g_first + 4 * g_second) / 12, atol=1e-6)
    # equal: the mean of each specialty's own mean
    equal = _sgd_gradient(tiny_policy, "equal", [first, second])
    assert torch.allclose(equal, (g_first + g_second) / 2, atol=1e-6)
    # projected: each half-weighted gradient without its component along the other, then summed
    projected = _sgd_gradient(tiny_policy, "projected", [first, second])
    assert torch.allclose(projected, project_conflicts([g_first / 2, g_second / 2]), atol=1e-6)
    assert not torch.allclose(projected, equal, atol=1e-4)
    # one specialty alone: every weighting is the plain update
    assert torch.allclose(_sgd_gradient(tiny_policy, "projected", [first]), g_first, atol=1e-7)


@pytest.mark.parametrize("weighting", ["projected", "separate_steps"])
def test_per_specialty_weightings_refuse_a_policy_split_across_stages(tiny_policy, weighting):
    optimizer = torch.optim.SGD(tiny_policy.parameters(), lr=1.0)
    with pytest.raises(ValueError, match=weighting):
        GRPOTrainer(TrainerConfig(specialty_weighting=weighting), tiny_policy, 0, 1.0, optimizer=optimizer)


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_separate_steps_give_each_specialty_its_own_adam_step(tiny_policy):
    """From fresh moments Adam's first step is lr * g / (|g| + eps): about lr * sign(g) on every coordinate the
    gradient touches. One AdamW per specialty steps each specialty's gradient so, and the steps add; one AdamW for
    both (the mutant) would step lr * sign(g_first + g_second): nothing where they cancel, lr where they agree."""
    import copy

    first, second = _specialty_groups()
    g_first = _sgd_gradient(tiny_policy, "tokens", [first])
    g_second = _sgd_gradient(tiny_policy, "tokens", [second])
    lr, eps = 1e-3, 1e-8  # eps: AdamW's default
    model = copy.deepcopy(tiny_policy)
    config = TrainerConfig(specialty_weighting="separate_steps", lr=lr, max_grad_norm=1e9)
    trainer = GRPOTrainer(config, model, pad_id=0, temperature=1.0)
    before = _flat(model)
    stats = trainer.step([first, second])
    step = before - _flat(model)
    expected = lr * (g_first / (g_first.abs() + eps) + g_second / (g_second.abs() + eps))
    # where a gradient is near eps, g / (|g| + eps) magnifies its float rounding: compare where each is 0 or clear of it
    clear = ((g_first == 0) | (g_first.abs() > 1e-6)) & ((g_second == 0) | (g_second.abs() > 1e-6))
    assert clear.float().mean() > 0.9
    assert torch.allclose(step[clear], expected[clear], atol=lr * 1e-3)
    one_optimizer = lr * torch.sign(g_first + g_second)
    assert not torch.allclose(step[clear], one_optimizer[clear], atol=lr * 0.5)
    assert stats.optimizer_steps == 2  # compute units charge an optimizer step per specialty
    assert len(trainer.optimizer.by_specialty) == 2
    # weight decay once a round, not once per specialty: the same step plus lr * wd * p
    decayed = copy.deepcopy(tiny_policy)
    config = TrainerConfig(specialty_weighting="separate_steps", lr=lr, max_grad_norm=1e9, weight_decay=0.5)
    GRPOTrainer(config, decayed, pad_id=0, temperature=1.0).step([first, second])
    decay_step = before - _flat(decayed)
    assert torch.allclose(decay_step[clear], (expected + lr * 0.5 * before)[clear], atol=lr * 1e-3)


def test_separate_steps_moments_survive_a_checkpoint(tiny_policy):
    """The per-specialty moments go through state_dict / load_state_dict: a restored trainer takes the same next step
    as the one that went on, and a trainer with fresh moments does not; a checkpoint of one AdamW for all specialties
    is refused with a sentence, not a KeyError."""
    import copy

    from node.trainer import SpecialtyAdamW

    first, second = _specialty_groups()
    config = TrainerConfig(specialty_weighting="separate_steps", lr=1e-3)
    model = copy.deepcopy(tiny_policy)
    trainer = GRPOTrainer(config, model, pad_id=0, temperature=1.0)
    trainer.step([first, second])
    restored = GRPOTrainer(config, copy.deepcopy(model), pad_id=0, temperature=1.0, policy_version=1)
    restored.optimizer.load_state_dict(copy.deepcopy(trainer.optimizer.state_dict()))
    fresh = GRPOTrainer(config, copy.deepcopy(model), pad_id=0, temperature=1.0, policy_version=1)
    for each in (trainer, restored, fresh):
        each.step([first, second])
    assert torch.allclose(_flat(model), _flat(restored.model), atol=1e-7)
    assert not torch.allclose(_flat(model), _flat(fresh.model), atol=1e-5)
    plain = torch.optim.AdamW(tiny_policy.parameters()).state_dict()
    with pytest.raises(ValueError, match="one AdamW for every specialty"):
        SpecialtyAdamW(tiny_policy.parameters(), 1e-3, (0.9, 0.99), 0.0).load_state_dict(plain)


def test_a_shared_prompt_forward_gives_each_rows_log_probs_and_distributions(tiny_policy):
    """Rows of two prompts, in mixed order, one of them repeated: one sequence per prompt, the same numbers as a row
    each, and the positions counted are the prompt once plus its completions."""
    from node.trainer import completion_distributions, padded_positions, prompt_sharing_supported

    rows = [([3, 4], [5, 1]), ([6], [7, 8, 9, 1]), ([3, 4], [10, 1]), ([3, 4], [5, 1]), ([6], [2])]
    apart = completion_distributions(tiny_policy, rows, pad_id=0, temperature=0.7)
    shared = completion_distributions(tiny_policy, rows, pad_id=0, temperature=0.7, share_prompts=True)
    for one, other in zip(apart, shared):
        assert one.shape == other.shape
        assert torch.allclose(one.float(), other.float(), atol=1e-6)
    # two sequences: [3, 4] and its answers (2 + 2 + 2 + 2 = 8), [6] and its answers (1 + 4 + 1 = 6), padded to 8
    assert padded_positions(rows, share_prompts=True) == 2 * 8
    assert padded_positions(rows) == 5 * 5
    assert prompt_sharing_supported(tiny_policy)

    class CarriesAConfig(torch.nn.Module):  # as a pipeline's remote model does: an HF config, but 2-D masks only
        config = tiny_policy.config

    assert not prompt_sharing_supported(CarriesAConfig())
    tiny_policy.config._attn_implementation = "flash_attention_2"  # takes no 4-D mask: each completion its own row
    try:
        assert not prompt_sharing_supported(tiny_policy)
        assert not GRPOTrainer(TrainerConfig(), tiny_policy, 0, 1.0).share_prompts
    finally:
        tiny_policy.config._attn_implementation = "sdpa"


@pytest.mark.parametrize("share_prompts", [False, True])
def test_log_probs_without_the_distributions_are_the_same_numbers_and_gradients(tiny_policy, share_prompts):
    """completion_logprobs (the scaled logit less its logsumexp, no vocabulary-wide tensor kept) against the token's
    entry in log_softmax's distribution: equal values and equal gradients of a loss on them."""
    from node.trainer import completion_distributions

    rows = [([3, 4], [5, 1]), ([6], [7, 8, 9, 1]), ([3, 4], [10, 1]), ([6], [2])]
    weights = torch.linspace(-1.0, 1.0, 4)[:, None]
    results = []
    for compute in ("logprobs", "distributions"):
        tiny_policy.zero_grad(set_to_none=True)
        if compute == "logprobs":
            logprobs, mask = completion_logprobs(tiny_policy, rows, 0, 0.7, share_prompts)
        else:
            logprobs, _, mask = completion_distributions(tiny_policy, rows, 0, 0.7, share_prompts)
        (logprobs * weights * mask).sum().backward()
        grads = torch.cat([p.grad.reshape(-1) for p in tiny_policy.parameters() if p.grad is not None])
        results.append((logprobs.detach(), mask, grads))
    (lean, lean_mask, lean_grads), (full, full_mask, full_grads) = results
    assert torch.equal(lean_mask, full_mask)
    assert torch.allclose(lean, full, atol=1e-5)
    assert (lean[lean_mask] < 0).all()  # real log-probs, not zeros
    assert torch.allclose(lean_grads, full_grads, atol=1e-5, rtol=1e-4)
    assert lean_grads.abs().sum() > 0
    tiny_policy.zero_grad(set_to_none=True)


def test_a_peers_wrong_answers_can_stay_out_of_the_policy_term(tiny_policy):
    """trainer.off_policy_negatives false: a peer's completions below its group's mean are not trained on; the node's
    own keep both signs. By hand: the peer's group [right, wrong] leaves its right answer alone (advantage +A), the own
    group [wrong, right] both rows; the policy term is -(sum of A x log-prob) over the 2 + 2 + 2 tokens kept."""
    import copy

    prompt = [3]
    peer = RolloutGroup(
        TaskSpec("x", {}, 0, 0),
        [_completion(prompt, [4, 1], -1), _completion(prompt, [5, 1], -1)],
        [1.0, 0.0],
        source="peer-a",
    )
    own = RolloutGroup(TaskSpec("x", {}, 1, 0), [_completion(prompt, [6, 1]), _completion(prompt, [7, 1])], [0.0, 1.0])
    model = copy.deepcopy(tiny_policy)
    trainer = GRPOTrainer(TrainerConfig(off_policy_negatives=False, max_grad_norm=1e9), model, 0, 1.0)
    rows = trainer.training_rows([peer, own])
    assert [row.completion_ids for row in rows] == [[4, 1], [6, 1], [7, 1]]
    trainer.step([peer, own])
    advantage = 0.5 / (math.sqrt(0.5) + TrainerConfig().advantage_eps)
    reference = copy.deepcopy(tiny_policy)
    logprobs, _ = completion_logprobs(reference, [(prompt, [4, 1]), (prompt, [6, 1]), (prompt, [7, 1])], 0, 1.0)
    (-advantage * logprobs[0].sum() + advantage * logprobs[1].sum() - advantage * logprobs[2].sum()).div(6).backward()
    assert torch.allclose(_flat_grad(model), _flat_grad(reference), atol=1e-5)
    # the default trains on both signs of a peer's group
    both = GRPOTrainer(TrainerConfig(), copy.deepcopy(tiny_policy), 0, 1.0).training_rows([peer, own])
    assert len(both) == 4


def _kl_gradient(tiny_policy, groups: list[RolloutGroup], kl_beta: float, anchored) -> tuple[torch.Tensor, int]:
    """The update's gradient (a plain SGD step of rate 1, no clipping) of a policy moved off its reference, and the
    token positions of its no-grad forwards."""
    import copy

    model = copy.deepcopy(tiny_policy)
    trainer = GRPOTrainer(
        TrainerConfig(kl_beta=kl_beta, max_grad_norm=1e9), model, pad_id=0, temperature=1.0, kl_specialties=anchored
    )
    torch.manual_seed(1)
    with torch.no_grad():  # after the reference was taken: the KL and its gradient are not zero
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    trainer.optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    before = torch.cat([p.detach().flatten() for p in model.parameters()])
    stats = trainer.step(groups)
    return before - torch.cat([p.detach().flatten() for p in model.parameters()]), stats.forward_tokens


def test_the_kl_anchor_applies_to_the_named_specialties_only(tiny_policy):
    from node.config import DatasetConfig
    from node.trainer import specialty_key, specialty_keys

    first, second = _specialty_groups()
    datasets = [DatasetConfig(name="x", config={"op": "+"}, label="add"), DatasetConfig(name="x", config={"op": "-"})]
    assert specialty_keys(datasets, ["add"]) == {specialty_key(first.spec)} and specialty_keys(datasets, []) is None
    plain, _ = _kl_gradient(tiny_policy, [first, second], 0.0, None)
    every, _ = _kl_gradient(tiny_policy, [first, second], 1.0, None)
    on_first, _ = _kl_gradient(tiny_policy, [first, second], 1.0, frozenset({specialty_key(first.spec)}))
    on_second, _ = _kl_gradient(tiny_policy, [first, second], 1.0, frozenset({specialty_key(second.spec)}))
    # the KL term is a sum over rows: each specialty's part adds to the plain gradient, and the two parts make the whole
    assert not torch.allclose(on_second, every, atol=1e-6) and not torch.allclose(on_first, plain, atol=1e-6)
    assert torch.allclose(on_first + on_second - plain, every, atol=1e-6)
    # a batch with no anchored row runs no reference forward and takes the plain step
    alone, positions = _kl_gradient(tiny_policy, [first], 1.0, frozenset({specialty_key(second.spec)}))
    assert positions == 0 and torch.allclose(alone, _kl_gradient(tiny_policy, [first], 0.0, None)[0], atol=1e-7)


def test_gradient_checkpointing_steps_to_the_same_weights_and_is_refused_where_it_cannot_apply(tiny_policy):
    """trainer.gradient_checkpointing recomputes the layers' activations in the backward: the same step to the last
    bit of float32 noise, with the checkpointing really on in training mode; a model that is not a transformers one
    (a pipeline's remote model) is refused in one line."""
    from node.config import ConfigError

    prompt = [3, 4, 5]
    rows = [[8, 9, 1], [10, 11, 1], [12, 1]]
    with torch.no_grad():
        behaviour, _ = completion_logprobs(tiny_policy, [(prompt, c) for c in rows], 0, 1.0)
    completions = [_completion(prompt, c, logprobs=behaviour[i, : len(c)].tolist()) for i, c in enumerate(rows)]
    start = copy.deepcopy(tiny_policy.state_dict())
    stepped = {}
    for checkpointing in (False, True):
        model = copy.deepcopy(tiny_policy)
        model.load_state_dict(start)
        trainer = GRPOTrainer(
            TrainerConfig(lr=1e-2, micro_batch_size=2, gradient_checkpointing=checkpointing), model, 0, 1.0
        )
        on = model.is_activation_checkpointing if hasattr(model, "is_activation_checkpointing") else None
        assert on == checkpointing or on is None and model.is_gradient_checkpointing == checkpointing
        trainer.step([RolloutGroup(TaskSpec("x", {}, 0, 0), completions, rewards=[1.0, 0.0, 0.5])])
        stepped[checkpointing] = model.state_dict()
    for name, tensor in stepped[False].items():
        assert torch.allclose(tensor, stepped[True][name], atol=1e-6), name
    assert any(not torch.equal(stepped[True][name], start[name]) for name in start)

    class RemoteModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(1))

    with pytest.raises(ConfigError, match="gradient_checkpointing: RemoteModel does not support it"):
        GRPOTrainer(TrainerConfig(gradient_checkpointing=True), RemoteModel(), 0, 1.0)
