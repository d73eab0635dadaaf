import copy
import math

import pytest
import torch

from node.config import TrainerConfig
from node.rollouts.base import Completion
from node.trainer import (
    Demonstration,
    GRPOTrainer,
    RolloutGroup,
    TrainingBatch,
    completion_logprobs,
    group_advantages,
    policy_loss,
)
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
    stats = trainer.step(TrainingBatch([RolloutGroup(TaskSpec("x", {}, 0, 0), completions, rewards=[1.0, 0.0])]))
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
    stats = trainer.step(TrainingBatch([uniform, empty]))
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
    gradients = []
    for micro in (1, 64):
        model = copy.deepcopy(tiny_policy)
        trainer = GRPOTrainer(TrainerConfig(micro_batch_size=micro, lr=1e-3), model, pad_id=0, temperature=1.0)
        trainer.step(TrainingBatch(groups))
        # the gradient the step applied (kept after it, clipped), not the weights after AdamW: Adam divides by the
        # root of the second moment, so a parameter whose gradient is float noise (~1e-9) moves by up to lr either way
        # and the weights differ by more than summation order explains, on some CPUs
        gradients.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert gradients[0].abs().max() > 1e-3  # a step that learned something
    assert torch.allclose(gradients[0], gradients[1], rtol=1e-5, atol=1e-7)


def test_off_policy_samples_get_a_truncated_importance_weight(tiny_policy):
    trainer = GRPOTrainer(TrainerConfig(importance_cap=2.0), tiny_policy, pad_id=0, temperature=1.0, policy_version=5)
    with torch.no_grad():
        current, _ = completion_logprobs(tiny_policy, [([3], [4, 5])], 0, 1.0)
    # behaviour much less likely than now -> weight capped at 2; much more likely -> weight < 1
    stale_low = _completion([3], [4, 5], version=1, logprobs=(current[0] - 5.0).tolist())
    stale_high = _completion([3], [4, 5], version=1, logprobs=(current[0] + 0.5).tolist())
    rows = trainer.training_rows(
        TrainingBatch([RolloutGroup(TaskSpec("x", {}, 0, 0), [stale_low, stale_high], [1.0, 0.0])])
    )
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
        trainer.step(
            TrainingBatch([RolloutGroup(TaskSpec("x", {}, 0, 0), [on_policy, on_policy], [1.0, 0.0])])
        ).importance_weight_mean
        is None
    )
    with torch.no_grad():  # the first step moved the policy: take the behaviour log-probs from where it is now
        current, _ = completion_logprobs(tiny_policy, [([3], [4, 5])], 0, 1.0)
    trainer.policy_version = 5
    on_policy = _completion([3], [4, 5], version=5, logprobs=current[0].tolist())
    stale_high = _completion([3], [4, 5], version=1, logprobs=(current[0] + 0.5).tolist())
    stats = trainer.step(TrainingBatch([RolloutGroup(TaskSpec("x", {}, 0, 0), [on_policy, stale_high], [1.0, 0.0])]))
    # only the off-policy sample's two tokens count
    assert stats.importance_weight_mean == pytest.approx(math.exp(-0.5), abs=1e-4)


def _all_right(completions: list[Completion], correct: list[bool]) -> RolloutGroup:
    """A group of right answers (all rewarded alike: no spread for the policy term)."""
    return RolloutGroup(
        TaskSpec("x", {}, 0, 0), completions, rewards=[1.0] * len(completions), source="peer", correct=correct
    )


def _marked(group: RolloutGroup, weight: float) -> list[Demonstration]:
    """The group's right answers as demonstrations of this weight (what node/sharing.py RoundPlan marks)."""
    return [Demonstration(weight, answer) for answer in group.right_answers()]


def test_right_answers_are_the_distinct_right_completions_of_a_group():
    right, again, wrong = _completion([3], [4, 1]), _completion([3], [4, 1]), _completion([3], [5, 1])
    group = _all_right([right, again, wrong], [True, True, False])
    assert group.right_answers() == [right]  # the same tokens twice teach nothing twice; a wrong answer never
    # no verdicts: nothing
    assert RolloutGroup(TaskSpec("x", {}, 0, 0), [right], [1.0]).right_answers() == []


def test_the_imitation_term_learns_demonstrations_the_policy_term_drops(tiny_policy):
    """A group whose answers are all right has no reward spread: GRPO drops it, the imitation term learns it."""
    prompt, answer = [3, 4], [8, 9, 1]
    with torch.no_grad():
        before, _ = completion_logprobs(tiny_policy, [(prompt, answer)], 0, 1.0)
    trainer = GRPOTrainer(TrainerConfig(lr=1e-2, imitation_coef=1.0), tiny_policy, pad_id=0, temperature=1.0)
    group = _all_right([_completion(prompt, answer)] * 2, [True, True])
    stats = trainer.step(TrainingBatch([group], _marked(group, 1.0)))
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

    def gradient(coef: float, groups: list[RolloutGroup], demonstrations: list[Demonstration] = ()) -> torch.Tensor:
        model = copy.deepcopy(tiny_policy)
        GRPOTrainer(TrainerConfig(imitation_coef=coef, max_grad_norm=1e9), model, pad_id=0, temperature=1.0).step(
            TrainingBatch(groups, list(demonstrations))
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
    demonstration = _all_right([_completion(prompt, demo)], [True])
    assert torch.allclose(
        gradient(2.0, [policy_group, demonstration], _marked(demonstration, 0.5)), expected, atol=1e-5
    )
    # a group given as demonstrations only: its reward spread stays out of the policy term, its right answer is learned
    peer = RolloutGroup(
        TaskSpec("x", {}, 0, 0),
        [_completion(prompt, demo), _completion(prompt, bad)],
        [1.0, 0.0],
        correct=[True, False],
    )
    assert torch.allclose(gradient(2.0, [policy_group], _marked(peer, 0.5)), expected, atol=1e-5)
    # off: demonstrations ignored
    assert torch.allclose(
        gradient(0.0, [policy_group, demonstration], _marked(demonstration, 0.5)), gradient(0.0, [policy_group])
    )

    plain = GRPOTrainer(TrainerConfig(imitation_coef=0.0), copy.deepcopy(tiny_policy), pad_id=0, temperature=1.0)
    assert not plain.step(TrainingBatch([demonstration], _marked(demonstration, 1.0))).stepped
    many = [Demonstration(0.1 * (i + 1), _completion(prompt, [4 + i, 1])) for i in range(6)]
    capped = GRPOTrainer(
        TrainerConfig(imitation_coef=1.0, imitation_max_sequences=4),
        copy.deepcopy(tiny_policy),
        pad_id=0,
        temperature=1.0,
    )
    assert capped.step(TrainingBatch([], many)).imitation_sequences == 4  # the four heaviest


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
    stats = trainer.step(TrainingBatch([peer]))
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
    two_epochs = two.step(TrainingBatch([peer]))
    assert two_epochs.forward_tokens == 1 + 2 + 2
    assert two_epochs.train_calls == 2  # one micro-batch, each epoch
    # a micro-batch a row: a call each, and each row carries its prompt again
    single = GRPOTrainer(TrainerConfig(micro_batch_size=1), copy.deepcopy(tiny_policy), 0, 1.0, policy_version=5)
    one_by_one = single.step(TrainingBatch([peer]))
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
    )
    model = copy.deepcopy(tiny_policy)
    trainer = GRPOTrainer(TrainerConfig(imitation_coef=2.0, max_grad_norm=1e9), model, 0, 1.0)
    stats = trainer.step(TrainingBatch([group], _marked(group, 0.5)))
    assert stats.train_tokens == 1 + 2 + 3 and stats.forward_tokens == 0 and stats.imitation_sequences == 1
    # off-policy rows (no behaviour log-probs): ratio 1; policy term over 5 tokens; imitation 2 x 0.5 x NLL(good) / 2
    advantage = 0.5 / (math.sqrt(0.5) + TrainerConfig().advantage_eps)
    reference = copy.deepcopy(tiny_policy)
    logprobs, _ = completion_logprobs(reference, [(prompt, good), (prompt, bad)], 0, 1.0)
    policy = (-advantage * logprobs[0, :2].sum() + advantage * logprobs[1, :3].sum()) / 5
    (policy + 2.0 * 0.5 * -logprobs[0, :2].sum() / 2).backward()
    assert torch.allclose(_flat_grad(model), _flat_grad(reference), atol=1e-5)


def test_a_shared_prompt_forward_gives_each_rows_log_probs(tiny_policy):
    """Rows of two prompts, in mixed order, one of them repeated: one sequence per prompt, the same numbers as a row
    each, and the positions counted are the prompt once plus its completions."""
    from node.trainer import padded_positions, prompt_sharing_supported

    rows = [([3, 4], [5, 1]), ([6], [7, 8, 9, 1]), ([3, 4], [10, 1]), ([3, 4], [5, 1]), ([6], [2])]
    apart = completion_logprobs(tiny_policy, rows, pad_id=0, temperature=0.7)
    shared = completion_logprobs(tiny_policy, rows, pad_id=0, temperature=0.7, share_prompts=True)
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


def _logprobs_from_distributions(model, rows, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Each completion token's entry in log_softmax's whole next-token distribution, a row at a time (positions
    0..n-1, no padding): the textbook computation completion_logprobs must agree with."""
    width = max(len(completion) for _, completion in rows)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    picked = []
    for i, (prompt, completion) in enumerate(rows):
        ids = torch.tensor([prompt + completion])
        distributions = torch.log_softmax(model(input_ids=ids).logits[0].float() / temperature, dim=-1)
        at = torch.arange(len(prompt) - 1, len(prompt) + len(completion) - 1)
        picked.append(distributions[at, torch.tensor(completion)])
        mask[i, : len(completion)] = True
    return torch.zeros(len(rows), width).masked_scatter(mask, torch.cat(picked)), mask


@pytest.mark.parametrize("share_prompts", [False, True])
def test_log_probs_are_the_tokens_entries_of_the_whole_distribution_values_and_gradients(tiny_policy, share_prompts):
    """completion_logprobs (the scaled logit less its logsumexp, no vocabulary-wide tensor kept) against the token's
    entry in log_softmax's distribution: equal values and equal gradients of a loss on them."""
    rows = [([3, 4], [5, 1]), ([6], [7, 8, 9, 1]), ([3, 4], [10, 1]), ([6], [2])]
    weights = torch.linspace(-1.0, 1.0, 4)[:, None]
    results = []
    for compute in ("logprobs", "distributions"):
        tiny_policy.zero_grad(set_to_none=True)
        if compute == "logprobs":
            logprobs, mask = completion_logprobs(tiny_policy, rows, 0, 0.7, share_prompts)
        else:
            logprobs, mask = _logprobs_from_distributions(tiny_policy, rows, 0.7)
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


def test_the_kl_penalty_moves_the_step_and_costs_one_reference_forward(tiny_policy):
    """trainer.kl_beta > 0: the step of a policy moved off its frozen reference differs from the plain one, by a
    reference forward over each micro-batch (counted in the no-grad positions); kl_beta 0 keeps no reference."""
    from node.trainer import padded_positions

    group = RolloutGroup(
        TaskSpec("x", {}, 0, 0), [_completion([3, 4], [5, 6, 7, 1]), _completion([3, 4], [8, 1])], [1.0, 0.0]
    )
    steps = {}
    for kl_beta in (0.0, 1.0):
        model = copy.deepcopy(tiny_policy)
        trainer = GRPOTrainer(TrainerConfig(kl_beta=kl_beta, max_grad_norm=1e9), model, pad_id=0, temperature=1.0)
        assert (trainer.reference is None) == (kl_beta == 0)
        torch.manual_seed(1)
        with torch.no_grad():  # after the reference was taken: the KL and its gradient are not zero
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        trainer.optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        before = torch.cat([p.detach().flatten() for p in model.parameters()])
        stats = trainer.step(TrainingBatch([group]))
        steps[kl_beta] = (before - torch.cat([p.detach().flatten() for p in model.parameters()]), stats)
    (plain, plain_stats), (anchored, anchored_stats) = steps[0.0], steps[1.0]
    assert not torch.allclose(plain, anchored, atol=1e-6)
    assert plain_stats.kl == 0 and anchored_stats.kl > 0
    pairs = [(c.prompt_ids, c.completion_ids) for c in group.completions]
    assert anchored_stats.forward_tokens - plain_stats.forward_tokens == padded_positions(pairs, share_prompts=True)


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
        trainer.step(TrainingBatch([RolloutGroup(TaskSpec("x", {}, 0, 0), completions, rewards=[1.0, 0.0, 0.5])]))
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


def test_an_update_whose_step_the_optimizer_could_not_apply_is_no_policy_version(tiny_policy):
    """An optimizer whose step did not reach every part of the policy (a stage server of a split policy that did not
    answer) says so with StepNotApplied: the round takes no further epoch, and reports no step and keeps its policy
    version unless an earlier epoch was applied."""
    from node.trainer.grpo import StepNotApplied

    class Unapplied:
        param_groups: list = []

        def __init__(self, applied: int) -> None:
            self.steps, self.applied = 0, applied

        def zero_grad(self, set_to_none: bool = True) -> None:
            tiny_policy.zero_grad(set_to_none=set_to_none)

        def step(self) -> None:
            self.steps += 1
            if self.steps > self.applied:
                raise StepNotApplied("stage 1 did not apply the step")

    prompt = [3, 4, 5]
    with torch.no_grad():
        before, _ = completion_logprobs(tiny_policy, [(prompt, [8, 9]), (prompt, [10, 11])], 0, 1.0)
    completions = [
        _completion(prompt, [8, 9], logprobs=before[0].tolist()),
        _completion(prompt, [10, 11], logprobs=before[1].tolist()),
    ]
    batch = TrainingBatch([RolloutGroup(TaskSpec("x", {}, 0, 0), completions, rewards=[1.0, 0.0])])
    optimizer = Unapplied(applied=0)
    trainer = GRPOTrainer(TrainerConfig(epochs_per_round=3), tiny_policy, 0, 1.0, optimizer=optimizer)
    stats = trainer.step(batch)
    assert not stats.stepped and trainer.policy_version == 0
    assert optimizer.steps == 1 and stats.optimizer_steps == 0
    assert math.isfinite(stats.loss) and stats.tokens == 4

    optimizer = Unapplied(applied=1)  # the first epoch applied, the second not: the policy moved once
    trainer = GRPOTrainer(TrainerConfig(epochs_per_round=3), tiny_policy, 0, 1.0, optimizer=optimizer)
    stats = trainer.step(batch)
    assert stats.stepped and trainer.policy_version == 1
    assert optimizer.steps == 2 and stats.optimizer_steps == 1
