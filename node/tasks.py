"""Verifiable tasks: questions re-derived from specs, prompts, answer extraction, rewards.

A question is never trusted from its text: everything is re-generated from its `TaskSpec`
(dataset, config, seed, index) with reasoning-gym, which is deterministic given the spec.
The reward is the dataset's own scorer applied to the answer we extract.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import random
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import reasoning_gym

from node.config import ConfigError, TasksConfig
from node.rollouts.base import Completion, RolloutGroup
from protocol.specs import TaskSpec

log = logging.getLogger(__name__)

# reasoning-gym datasets are virtual: an item depends only on (seed, index), but the
# dataset object refuses indices beyond its declared size. Declare a size large enough
# for any index a node will ever ask for.
_VIRTUAL_SIZE = 2**31 - 1
# A few datasets draw a list of `size` entries in their constructor (gsm_symbolic picks a template per item): at the
# virtual size that list fills the machine's memory. They get a size that fits, and an index wraps around it (a
# stream repeats its questions after that many draws).
_BOUNDED_SIZE = {"gsm_symbolic": 1_000_000}

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


class TaskError(ConfigError):
    """A spec that cannot be turned into a question (unknown dataset, bad config)."""


@dataclass(frozen=True)
class SpecialtyScore:
    """A specialty's greedy evaluation. One distinct answer given for questions with several right
    ones: the policy learned the answers' prior, not the task (RL then only shifts that prior)."""

    accuracy: float
    distinct_given: int
    distinct_right: int


@dataclass(frozen=True)
class Question:
    spec: TaskSpec
    text: str
    answer: str  # reference answer re-derived locally; never taken from a peer
    entry: dict[str, Any]  # the dataset's own item, needed by its scorer


def _create(name: str, config: dict, seed: int):
    try:
        return reasoning_gym.create_dataset(name, seed=seed, size=_BOUNDED_SIZE.get(name, _VIRTUAL_SIZE), **config)
    except Exception as exc:  # reasoning-gym raises assorted types for unknown names/bad configs
        raise TaskError(f"cannot create dataset {name!r} with config {config}: {exc}") from None


def _reseeded(dataset, seed: int):
    """A view of `dataset` that draws its items from `seed`: it shares everything its constructor built."""
    view = copy.copy(dataset)
    view.seed = seed
    if dataclasses.is_dataclass(dataset.config) and hasattr(dataset.config, "seed"):
        view.config = dataclasses.replace(dataset.config, seed=seed)
    return view


_PROBE_SEED, _PROBE_INDICES = 7919, (0, 1, 2, 1_000_003)


@lru_cache(maxsize=128)
def _prototype(name: str, config_key: str) -> tuple[Any, bool]:
    """One dataset per (name, config), and whether another seed's items come from a re-seeded view of it.

    Some datasets build their world in the constructor (letter_counting and spell_backward read and
    split a word list: ~0.1 s idle, seconds on a loaded machine, ~0.5 MiB each), and every peer
    stream has its own seed, so building one dataset per seed made re-scoring a swarm's groups slow
    and the cache thrash. Whether a view is faithful is checked here, once, against a dataset
    built for a probe seed; a dataset whose constructor uses its seed is built per seed instead.
    """
    config = json.loads(config_key)
    prototype = _create(name, config, seed=0)
    built, viewed = _create(name, config, seed=_PROBE_SEED), _reseeded(prototype, _PROBE_SEED)
    try:
        faithful = all(built[i] == viewed[i] for i in _PROBE_INDICES)
    except Exception:  # an item that cannot be drawn or compared: build per seed
        faithful = False
    if not faithful:
        log.debug("dataset %s: items depend on more than its seed attribute; built once per seed", name)
    return prototype, faithful


@lru_cache(maxsize=1024)  # a view is a shallow copy (~1 KiB): room for every peer stream x specialty of a large swarm
def _view(name: str, config_key: str, seed: int):
    return _reseeded(_prototype(name, config_key)[0], seed)


@lru_cache(maxsize=64)  # a dataset that cannot be viewed: a whole one per seed
def _built(name: str, config_key: str, seed: int):
    return _create(name, json.loads(config_key), seed)


def dataset_for(spec: TaskSpec):
    """The reasoning-gym dataset a spec's question is drawn from (its name, config and seed), built once and cached."""
    return (
        _view(spec.dataset, spec.config_key, spec.seed)
        if _prototype(spec.dataset, spec.config_key)[1]
        else _built(spec.dataset, spec.config_key, spec.seed)
    )


def is_viewed(spec: TaskSpec) -> bool:
    """Whether other seeds of the spec's dataset are re-seeded views of one built dataset (see `_prototype`)."""
    return _prototype(spec.dataset, spec.config_key)[1]


def forget_datasets() -> None:
    """Drop every cached dataset: the next question builds them again (after reasoning-gym changed under us)."""
    for cache in (_prototype, _view, _built):
        cache.cache_clear()


def materialize(spec: TaskSpec) -> Question:
    """Re-generate the question and its ground truth from the spec (deterministic)."""
    dataset = dataset_for(spec)
    try:
        entry = dataset[spec.index % _BOUNDED_SIZE.get(spec.dataset, _VIRTUAL_SIZE)]
    except Exception as exc:
        raise TaskError(f"dataset {spec.dataset!r} cannot produce item {spec.index}: {exc}") from None
    return Question(spec=spec, text=entry["question"], answer=str(entry["answer"]), entry=entry)


_NUMBER = re.compile(r"-?\d+(?:[.,]\d+)*")


def extract_answer(completion: str, rule: str = "first_line") -> str | None:
    """The answer a completion gives: the last <answer>…</answer> if tagged, else what `rule`
    (tasks.answer_extraction) reads: 'first_line', its first line; 'final_number', the last number after the '='
    of the first line that has one, else the last number of its first non-empty line."""
    tagged = _ANSWER_TAG.findall(completion)
    if tagged:
        return tagged[-1].strip() or None
    if rule == "final_number":
        lines = [line for line in completion.split("\n") if line.strip()]
        with_equals = [line for line in lines if "=" in line]
        where = with_equals[0].rsplit("=", 1)[1] if with_equals else (lines[0] if lines else "")
        numbers = _NUMBER.findall(where)
        return numbers[-1].rstrip(".,").replace(",", "") if numbers else None
    first_line = completion.split("\n", 1)[0].strip()
    return first_line or None


@dataclass(frozen=True)
class Grade:
    reward: float  # what the trainer optimizes: correctness plus the optional format bonus
    correct: bool  # the dataset's scorer gave full marks


def grade(
    question: Question, completion: str, finished: bool, format_reward: float = 0.0, rule: str = "first_line"
) -> Grade:
    """The dataset's own scorer on the answer `rule` extracts (tasks.answer_extraction), plus an optional format
    bonus."""
    answer = extract_answer(completion, rule)
    if answer is None:
        return Grade(0.0, False)
    dataset = dataset_for(question.spec)
    try:
        correctness = float(dataset.score_answer(answer=answer, entry=question.entry))
    except Exception:  # a scorer that chokes on odd text (model output, a peer's) judges it wrong
        log.debug("scorer of %s raised on %r; scored 0", question.spec.dataset, answer[:80], exc_info=True)
        correctness = 0.0
    return Grade(correctness + (format_reward if finished else 0.0), correctness >= 1.0)


def score_group(
    question: Question, completions: list[Completion], source: str, format_reward: float, rule: str = "first_line"
) -> tuple[RolloutGroup, int]:
    """The group with its locally computed rewards, and how many of its completions are right."""
    grades = [grade(question, c.text, c.finish_reason == "stop", format_reward, rule) for c in completions]
    group = RolloutGroup(
        spec=question.spec,
        completions=completions,
        rewards=[g.reward for g in grades],
        source=source,
        correct=[g.correct for g in grades],
    )
    return group, sum(g.correct for g in grades)


class PromptFormat:
    """How a question becomes the text a model is prompted with (tasks.prompt_format), for one tokenizer.

    A chat prompt is the tokenizer's own chat template over a system turn (tasks.system_prompt, or the template's
    default) and the user's turn, with the assistant's turn opened, as instruct models were tuned on. A template
    prompt is tasks.prompt_template filled in; it must end where the tokenizer ends a token, or the prompt's last
    token (a lone ' ' in a BPE vocabulary) would be one the model never saw before an answer.
    """

    def __init__(self, config: TasksConfig, tokenizer=None):
        """Without a tokenizer (a TaskSource that only draws questions), a chat format is checked when one comes."""
        self.config = config
        self.tokenizer = tokenizer
        has_template = tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))
        self.kind = config.prompt_format if config.prompt_format != "auto" else ("chat" if has_template else "template")
        if self.kind == "chat" and not has_template and tokenizer is not None:
            raise ConfigError(
                "tasks.prompt_format is 'chat' but the model's tokenizer has no chat template: set "
                "tasks.prompt_format=template (with tasks.prompt_template) or use an instruct model's tokenizer"
            )
        if self.kind == "template" and tokenizer is not None:
            probe = self(_PROBE_QUESTION)
            # an answer in words shows the trap where one in digits may not (Qwen's vocabulary splits off every digit)
            alone, followed = (
                tokenizer.encode(probe, add_special_tokens=False),
                tokenizer.encode(probe + "yes 12", add_special_tokens=False),
            )
            if followed[: len(alone)] != alone:
                raise ConfigError(
                    f"tasks.prompt_template {config.prompt_template!r} ends inside a token of this model's tokenizer "
                    f"(its last token {tokenizer.decode(alone[-1:])!r} is not how an answer would start): end it "
                    "without the trailing space, e.g. '{question}\\nAnswer:'"
                )

    def __call__(self, question_text: str) -> str:
        if self.kind == "template":
            return self.config.prompt_template.format(question=question_text)
        if self.tokenizer is None:
            raise ValueError("a chat prompt needs the model's tokenizer: build the TaskSource with for_tokenizer()")
        turns = [] if self.config.system_prompt is None else [{"role": "system", "content": self.config.system_prompt}]
        turns.append({"role": "user", "content": self.config.user_template.format(question=question_text)})
        return self.tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)


_PROBE_QUESTION = "What is 7 + 5?"


class TaskSource:
    """Draws this node's training questions from the weighted mix, reproducibly by index."""

    def __init__(self, config: TasksConfig, seed: int, prompt_format: PromptFormat | None = None):
        self.config = config
        self.seed = seed
        self.prompt_format = prompt_format or PromptFormat(config)
        self._weights = [d.weight for d in config.datasets]
        self._labels = {(d.name, TaskSpec(d.name, d.config, 0, 0).config_key): d.display_label for d in config.datasets}
        # Validate every dataset of the mix at start, not at the first unlucky draw.
        for dataset in config.datasets:
            materialize(TaskSpec(dataset.name, dataset.config, seed, 0))

    def spec(self, draw: int) -> TaskSpec:
        """The `draw`-th question of this node's stream (same draw, same spec)."""
        picker = random.Random(f"{self.seed}:{draw}")
        dataset = picker.choices(self.config.datasets, weights=self._weights)[0]
        return TaskSpec(dataset.name, dataset.config, self.seed, draw)

    def label(self, spec: TaskSpec) -> str:
        """The specialty a question belongs to (its mix entry's label; a peer's dataset outside our mix: its name)."""
        return self._labels.get((spec.dataset, spec.config_key), spec.dataset)

    def batch(self, first_draw: int, count: int) -> list[Question]:
        return [materialize(self.spec(first_draw + i)) for i in range(count)]

    @property
    def mix_weights(self) -> dict[str, float]:
        """Each specialty's share of the mix (weights normalized)."""
        total = sum(self._weights)
        return {d.display_label: w / total for d, w in zip(self.config.datasets, self._weights)}

    def batch_by_label(self, first_draw: int, counts: dict[str, int]) -> list[Question]:
        """counts[label] questions of each specialty: draws first_draw.. of that specialty's own dataset stream (the
        same draws, the same questions; specialties are different datasets, so their draws never coincide)."""
        by_label = {d.display_label: d for d in self.config.datasets}
        unknown = sorted(set(counts) - set(by_label))
        if unknown:
            raise TaskError(f"no specialties {unknown} in the task mix {sorted(by_label)}")
        return [
            materialize(TaskSpec(by_label[label].name, by_label[label].config, self.seed, first_draw + i))
            for label, count in counts.items()
            for i in range(count)
        ]

    def prompt(self, question: Question) -> str:
        return self.prompt_format(question.text)

    def for_tokenizer(self, tokenizer) -> TaskSource:
        """The same question stream, prompted the way tasks.prompt_format says for this tokenizer (a chat template
        where it has one, by default)."""
        return TaskSource(self.config, self.seed, PromptFormat(self.config, tokenizer))

    def heldout(self) -> list[Question]:
        """A fixed evaluation set, disjoint in seed from every training stream."""
        return TaskSource(self.config, self.config.heldout_seed).batch(0, self.config.heldout_size)

    def score_answers(
        self, questions: list[Question], completions: list[str]
    ) -> tuple[float, dict[str, SpecialtyScore]]:
        """Accuracy of one completion per question (a greedy evaluation), overall and per specialty."""
        tallies: dict[str, tuple[list[bool], set, set]] = {}
        right = []
        for question, completion in zip(questions, completions, strict=True):
            correct, given, true = tallies.setdefault(self.label(question.spec), ([], set(), set()))
            right.append(grade(question, completion, True, rule=self.config.answer_extraction).correct)
            correct.append(right[-1])
            given.add(extract_answer(completion, self.config.answer_extraction))
            true.add(question.answer)
        by_label = {
            label: SpecialtyScore(sum(correct) / len(correct), len(given), len(true))
            for label, (correct, given, true) in sorted(tallies.items())
        }
        return sum(right) / len(right), by_label
