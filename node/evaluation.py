"""Held-out evaluation: greedy answers to a fixed question set no training stream draws from."""

from __future__ import annotations

from node.rollouts.base import RolloutBackend
from node.tasks import Question, SpecialtyScore, TaskSource


class HeldoutEvaluator:
    def __init__(self, tasks: TaskSource, backend: RolloutBackend):
        self.tasks = tasks
        self.backend = backend
        self._questions: list[Question] | None = None

    def questions(self) -> list[Question]:
        """The node's held-out set (tasks.heldout_size questions from tasks.heldout_seed), drawn once."""
        if self._questions is None:
            self._questions = self.tasks.heldout()
        return self._questions

    def accuracy(self, questions: list[Question] | None = None) -> float:
        """Greedy accuracy on the held-out set (or on `questions`)."""
        return self.by_dataset(questions)[0]

    def by_dataset(self, questions: list[Question] | None = None) -> tuple[float, dict[str, float]]:
        """Greedy accuracy: overall, and per specialty of the task mix."""
        overall, scores = self.report(questions)
        return overall, {label: score.accuracy for label, score in scores.items()}

    def report(self, questions: list[Question] | None = None) -> tuple[float, dict[str, SpecialtyScore]]:
        """Greedy accuracy, and per specialty the distinct answers given and right."""
        questions = questions or self.questions()
        completions = self.backend.generate([self.tasks.prompt(q) for q in questions], n=1, seed=0, greedy=True)
        return self.tasks.score_answers(questions, [c[0].text for c in completions])
