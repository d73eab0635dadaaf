import dataclasses
import random

import pytest

from node.config import TasksConfig, DatasetConfig
from node.tasks import TaskError, TaskSource, extract_answer, grade, materialize
from protocol.specs import SpecError, TaskSpec
from tests.helpers.common import REPO

ARITH = {
    "min_terms": 2,
    "max_terms": 2,
    "min_digits": 1,
    "max_digits": 2,
    "operators": ["+", "-"],
    "allow_negation": False,
    "allow_parentheses": False,
}


def test_same_spec_same_question_and_answer():
    spec = TaskSpec("basic_arithmetic", ARITH, seed=7, index=123)
    first, again = materialize(spec), materialize(TaskSpec("basic_arithmetic", dict(ARITH), 7, 123))
    assert (first.text, first.answer) == (again.text, again.answer)
    texts = {materialize(TaskSpec("basic_arithmetic", ARITH, 7, i)).text for i in range(50)}
    assert len(texts) > 10  # ...but the stream is not constant


def test_answer_is_rederived_from_the_expression():
    question = materialize(TaskSpec("basic_arithmetic", ARITH, 3, 5))
    expression = question.entry["metadata"]["expression"]
    assert int(question.answer) == eval(expression)  # noqa: S307 - our own generated arithmetic


def test_source_stream_is_reproducible_and_seed_dependent():
    config = TasksConfig(
        datasets=[DatasetConfig(name="basic_arithmetic", config=ARITH), DatasetConfig(name="chain_sum", weight=3.0)]
    )
    a, b, other = TaskSource(config, 1), TaskSource(config, 1), TaskSource(config, 2)
    assert [a.spec(i) for i in range(20)] == [b.spec(i) for i in range(20)]
    assert [a.spec(i).key for i in range(20)] != [other.spec(i).key for i in range(20)]
    names = {a.spec(i).dataset for i in range(200)}
    assert names == {"basic_arithmetic", "chain_sum"}


def test_heldout_is_fixed_and_disjoint_in_seed():
    config = TasksConfig(heldout_size=5)
    source = TaskSource(config, seed=0)
    heldout = source.heldout()
    assert [q.spec for q in heldout] == [q.spec for q in TaskSource(config, seed=99).heldout()]
    assert all(q.spec.seed == config.heldout_seed != 0 for q in heldout)


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("12", "12"),
        (" 12 \nmore", "12"),
        ("think <answer>7</answer> x <answer> 8 </answer>", "8"),
        ("", None),
        ("\n12", None),
        ("<answer></answer>", None),
    ],
)
def test_extract_answer(completion, expected):
    assert extract_answer(completion) == expected


# Greedy answers SmolLM2-135M-Instruct gave through its chat template (benchmarks/base_accuracy.py's questions), and
# what the 'final_number' rule reads from each: the number after the '=' of the first line with one, else the last
# number of the first line. The rule reads, it does not judge: wrong sums are read as the model wrote them.
SMOLLM2_ANSWERS = [
    ("10 + 8 = 18", "18"),
    ("10 + 8 = 18\n\nThis is a classic example of a mathematical operation that can be performed", "18"),
    ("To calculate 6 + 2, we simply add them together. 6 + 2 equals 8.", "8"),
    ("The answer is 57.", "57"),
    ("43 + 14 = 17.", "17"),
    ("The final answer to the given arithmetic problem is 1.", "1"),
    ("To calculate 97 + 33, we need to add 97 and 33, which results in 120.", "120"),
    (
        "To add 88 + 94, we need to combine the numbers in a way that results in a single number with the opposite of "
        "the original number.\n\nFirst, we add the numbers: 88 + 94 = 176.\n\nNow, we take the opposite of 176",
        "176",
    ),
    ("11 dogs * 10 legs = 110 legs", "110"),
    ("1.15\n\nThe answer is 1.15.", "1.15"),
    # the last number of a first line that goes on after its answer: read as written (RL teaches the model to stop)
    ("To calculate 7 + 9, we simply add them together. 7 + 9 equals 16, which is the sum of 7 and 9.", "9"),
    ("To calculate 6 + 10 * 0. you need to multiply 6 by itself 10 times.", "10"),
    ("The sum is -3, not 1,000.", "1000"),
    ("It is <answer>42</answer>, i.e. 41 + 1 = 42", "42"),
    ("I cannot compute that.", None),
    ("", None),
]


@pytest.mark.parametrize("completion, expected", SMOLLM2_ANSWERS)
def test_final_number_reads_an_instruct_models_answer(completion, expected):
    assert extract_answer(completion, "final_number") == expected


def test_final_number_grades_a_real_answer_right_and_its_rambling_twin_wrong():
    spec = TaskSpec("basic_arithmetic", ARITH, seed=3, index=5)
    question = materialize(spec)
    stated = f"{question.entry['metadata']['expression']} = {question.answer}\n\nThis is a classic example."
    assert grade(question, stated, finished=True, rule="final_number").correct
    assert not grade(question, stated, finished=True).correct  # the first line, whole, is not the answer
    rambling = f"The answer is {question.answer}, and {question.answer} + 1 = {int(question.answer) + 1}."
    assert not grade(question, rambling, finished=True, rule="final_number").correct


def test_gsm_symbolic_draws_far_indices_without_filling_memory():
    """Its constructor draws a template per item of its declared size: a bounded size, indices wrapping around."""
    first = materialize(TaskSpec("gsm_symbolic", {}, seed=5, index=3))
    far = materialize(TaskSpec("gsm_symbolic", {}, seed=5, index=1_000_003))
    assert first.text == far.text and first.answer == far.answer
    assert first.answer.lstrip("-").isdigit()


def test_grade_uses_the_dataset_scorer_and_format_bonus():
    question = materialize(TaskSpec("basic_arithmetic", ARITH, 3, 5))
    right = grade(question, question.answer, finished=True, format_reward=0.1)
    assert right.correct and right.reward == pytest.approx(1.1)
    assert grade(question, question.answer, finished=False, format_reward=0.1).reward == pytest.approx(1.0)
    wrong = grade(question, "x", finished=True)
    assert not wrong.correct and wrong.reward == 0.0
    assert grade(question, "", finished=True).reward == 0.0


def test_prompt_template():
    config = TasksConfig(prompt_template="Q: {question}\nA: ")
    source = TaskSource(config, 0)
    question = source.batch(0, 1)[0]
    assert source.prompt(question) == f"Q: {question.text}\nA: "


def test_bad_specs_are_refused():
    with pytest.raises(TaskError):
        materialize(TaskSpec("no_such_dataset", {}, 0, 0))
    with pytest.raises(TaskError):
        materialize(TaskSpec("basic_arithmetic", {"min_terms": "many"}, 0, 0))
    for bad in [
        dict(dataset="", config={}, seed=0, index=0),
        dict(dataset="x", config={}, seed=-1, index=0),
        dict(dataset="x", config={}, seed=0, index=True),
        dict(dataset="x", config={"a": float("nan")}, seed=0, index=0),
    ]:
        with pytest.raises(SpecError):
            TaskSpec(**bad)
    with pytest.raises(SpecError):
        TaskSpec.from_wire({"dataset": "x", "config": {}, "seed": 0})


def test_distinct_specs_never_merge():
    a = TaskSpec("chain_sum", {"min_terms": 2}, 0, 1)
    b = TaskSpec("chain_sum", {"min_terms": 3}, 0, 1)
    assert a.key != b.key
    assert TaskSpec.from_wire(a.to_wire()) == a


def test_a_scorer_that_raises_grades_zero(monkeypatch):
    from node import tasks

    question = materialize(TaskSpec("basic_arithmetic", ARITH, 3, 5))
    dataset = tasks.dataset_for(question.spec)

    def explode(answer, entry):
        raise ValueError("cannot parse")

    monkeypatch.setattr(dataset, "score_answer", explode)
    assert grade(question, "{{{", finished=True) == tasks.Grade(0.0, False)


def test_a_seed_is_a_view_of_one_dataset_and_draws_what_a_fresh_dataset_draws():
    """Every peer stream has its own seed: the word-list datasets are built once and viewed per
    seed, and each view's questions and scoring equal those of a dataset built for that seed."""
    import reasoning_gym
    import yaml

    from node.tasks import dataset_for, is_viewed

    mix = yaml.safe_load((REPO / "configs" / "mix.yaml").read_text())["tasks"]["datasets"]
    for entry in mix:
        spec = TaskSpec(entry["name"], entry["config"], 0, 0)
        assert is_viewed(spec), f"{entry['name']} is rebuilt per seed"
        for seed in (3, 123_457):
            fresh = reasoning_gym.create_dataset(entry["name"], seed=seed, size=2**31 - 1, **entry["config"])
            viewed = dataset_for(TaskSpec(entry["name"], entry["config"], seed, 0))
            for index in (0, 17, 40_001):
                assert viewed[index] == fresh[index]
                question = materialize(TaskSpec(entry["name"], entry["config"], seed, index))
                assert grade(question, question.answer, True).correct
    spec = TaskSpec("spell_backward", {"min_word_len": 3, "max_word_len": 4}, 0, 0)
    assert dataset_for(dataclasses.replace(spec, seed=5)).words is dataset_for(dataclasses.replace(spec, seed=6)).words


def test_a_dataset_whose_constructor_uses_its_seed_is_built_per_seed(monkeypatch):
    import node.tasks as tasks

    class PoolDataset:  # draws from a pool its constructor shuffles with the seed: a view would be wrong
        def __init__(self, seed):
            self.seed, self.config = seed, None
            self.pool = list(range(1000))
            random.Random(seed).shuffle(self.pool)

        def __getitem__(self, index):
            return {"question": str(self.pool[(self.seed + index) % 1000]), "answer": "0"}

    monkeypatch.setattr(tasks.reasoning_gym, "create_dataset", lambda name, seed, size, **config: PoolDataset(seed))
    tasks.forget_datasets()
    try:
        assert tasks.is_viewed(TaskSpec("pool", {}, 5, 0)) is False
        assert tasks.dataset_for(TaskSpec("pool", {}, 5, 0))[3] == PoolDataset(5)[3]
        assert tasks.dataset_for(TaskSpec("pool", {}, 6, 0)).pool == PoolDataset(6).pool
    finally:
        tasks.forget_datasets()


def test_score_answers_counts_accuracy_and_distinct_answers_per_specialty():
    config = TasksConfig(
        datasets=[DatasetConfig(name="basic_arithmetic", label="arith", config=ARITH), DatasetConfig(name="chain_sum")]
    )
    source = TaskSource(config, seed=4)
    questions = [q for q in source.batch(0, 40)]
    arith = [q for q in questions if source.label(q.spec) == "arith"]
    chain = [q for q in questions if source.label(q.spec) == "chain_sum"]
    assert len(arith) >= 2 and len(chain) >= 2
    # every arithmetic question answered right; every chain_sum question answered with one constant
    overall, scores = source.score_answers(arith + chain, [q.answer for q in arith] + ["7"] * len(chain))
    assert scores["arith"].accuracy == 1.0
    assert scores["arith"].distinct_given == scores["arith"].distinct_right == len({q.answer for q in arith})
    assert scores["chain_sum"].distinct_given == 1
    assert scores["chain_sum"].distinct_right == len({q.answer for q in chain})
    assert scores["chain_sum"].accuracy == sum(q.answer == "7" for q in chain) / len(chain)
    assert overall == (len(arith) + sum(q.answer == "7" for q in chain)) / len(questions)
    assert list(scores) == ["arith", "chain_sum"]
